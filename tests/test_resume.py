"""--resume continues a run bit for bit, and refuses a run it cannot continue."""

import json

import pytest
import torch

from flashdraft.config import resolve_config
from flashdraft.data.packing import save_token_dataset
from flashdraft.train.build import build_trainer
from helpers import random_docs


@pytest.fixture(scope="module")
def data_dir(token_data_dir):
    return token_data_dir


def _cfg(**over):
    base = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 6, "epochs": 2}
    base.update({"drafter.num_layers": 1, "drafter.num_taps": 2, "log_every": 2, "optim.warmup_ratio": 0.2})
    return resolve_config("default", **{**base, **over})


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def test_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path, tiny_target_dir, data_dir):
    whole = build_trainer(_cfg(), tiny_target_dir, data_dir, tmp_path / "whole", device="cpu")
    whole.run()
    expected = _weights(whole)

    out = tmp_path / "stopped"
    first = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu")
    for _ in range(3):  # the process dies after the checkpoint of step 3
        first.train_step()
    first.save()
    resumed = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu", resume=True)
    assert resumed.step == 3
    resumed.run()
    got = _weights(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "step_000006"


def test_a_run_trained_in_slices_with_until_ends_equal_to_the_whole_run(tmp_path, tiny_target_dir, data_dir):
    whole = build_trainer(_cfg(), tiny_target_dir, data_dir, tmp_path / "whole", device="cpu")
    whole.run()
    out = tmp_path / "sliced"
    first = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu")
    part = first.run(until=3)
    assert (part.steps, first.step) == (3, 3) and not (out / "result.json").exists()
    first.close()
    second = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu", resume=True)
    with pytest.raises(ValueError, match="until=3: must lie after step 3"):
        second.run(until=3)
    assert second.run().steps == 6
    expected, got = _weights(whole), _weights(second)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3, 4, 6]  # the slice's last step is logged once; the log goes on after it


def test_a_slice_stops_on_its_deadline_with_a_checkpoint_that_resumes_to_the_whole_run(
    tmp_path, tiny_target_dir, data_dir, monkeypatch
):
    import dataclasses
    import time

    whole = build_trainer(_cfg(), tiny_target_dir, data_dir, tmp_path / "whole", device="cpu")
    whole.run()
    out = tmp_path / "sliced"
    first = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu")
    late, real, step = [0.0], time.time, first.train_step_guarded

    def train_step_guarded():  # the clock passes the deadline during step 3
        stats = step()
        late[0] = 1e7 if first.step == 3 else 0.0
        return stats

    monkeypatch.setattr(first, "train_step_guarded", train_step_guarded)
    monkeypatch.setattr(time, "time", lambda: real() + late[0])
    part = first.run(deadline=real() + 1e6)
    monkeypatch.undo()
    assert part.steps == first.step == 3 and not (out / "result.json").exists()
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "step_000003"
    first.close()
    second = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu", resume=True)
    assert second.run(deadline=time.time() + 1e6).steps == 6
    expected, got = _weights(whole), _weights(second)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3, 4, 6]  # the step it stopped at is logged
    second.topo = dataclasses.replace(second.topo, world_size=2)
    with pytest.raises(ValueError, match="cannot stop on the clock"):
        second.run(deadline=time.time())


def test_resume_refuses_a_changed_model_or_data_stream(tmp_path, tiny_target_dir, data_dir):
    out = tmp_path / "run"
    t = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu")
    t.train_step()
    t.save()
    with pytest.raises(ValueError, match="num_anchors: 8 -> 16"):
        build_trainer(_cfg(num_anchors=16), tiny_target_dir, data_dir, out, device="cpu", resume=True)
    with pytest.raises(ValueError, match="micro-batches per step"):
        build_trainer(_cfg(grad_accum=2), tiny_target_dir, data_dir, out, device="cpu", resume=True)
    build_trainer(_cfg(**{"optim.lr": 1e-4}), tiny_target_dir, data_dir, out, device="cpu", resume=True)


def test_resume_without_a_checkpoint_is_an_error(tmp_path, tiny_target_dir, data_dir):
    with pytest.raises(ValueError, match="no complete checkpoint"):
        build_trainer(_cfg(), tiny_target_dir, data_dir, tmp_path / "empty", device="cpu", resume=True)


def _poison(trainer, steps: set[int]):
    """Make the target's features NaN at the given steps (1-based), as a corrupt batch would: those of
    the steps' micro-batches, whenever the target computes them."""
    get, corrupt = trainer.features.get, {m for s in steps for m in trainer.micro_indices(s)}

    def poisoned(m, *args):
        batch, feats, *rest = get(m, *args)
        return batch, feats * float("nan") if m in corrupt else feats, *rest

    trainer.features.get = poisoned


def test_non_finite_steps_are_skipped_and_a_run_of_them_stops_at_the_last_good_state(
    tmp_path, tiny_target_dir, data_dir
):
    from flashdraft.train.state import NonFiniteError

    skip = build_trainer(_cfg(log_every=1), tiny_target_dir, data_dir, tmp_path / "skip", device="cpu")
    _poison(skip, {3, 4})
    skip.run()
    lines = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in lines] == [0, 0, 1, 2, 2, 2]
    assert all(torch.isfinite(p).all() for p in skip.drafter.parameters())

    reference = build_trainer(
        _cfg(log_every=1, max_bad_steps=2), tiny_target_dir, data_dir, tmp_path / "stop", device="cpu"
    )
    for _ in range(2):  # the two good steps, computed on their own
        reference.train_step()
    good = {k: v.clone() for k, v in reference.drafter.state_dict().items()}
    stop2 = build_trainer(
        _cfg(log_every=1, max_bad_steps=2), tiny_target_dir, data_dir, tmp_path / "stop2", device="cpu"
    )
    _poison(stop2, {3, 4, 5, 6})
    with pytest.raises(NonFiniteError, match="2 consecutive steps up to step 4"):
        stop2.run()
    saved = torch.load(
        tmp_path / "stop2" / "checkpoints" / "step_000004" / "trainer_state.pt", weights_only=True
    )
    assert all(torch.equal(saved["master"][k], good[k]) for k in good)


def test_a_resume_loads_the_checkpoints_compile_artifacts_only_when_trusted(
    tmp_path, tiny_target_dir, data_dir, monkeypatch, capsys
):
    """compile_cache.bin holds pickles that run code when loaded: a crafted one in a run directory or a
    bucket would run on the machine that resumes. By default a resume compiles again and says so."""
    out = tmp_path / "run"
    t = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu")
    t.train_step()
    ckpt = t.save()
    (ckpt / "compile_cache.bin").write_bytes(b"anything a bucket may hold")
    handed = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: handed.append(data))
    build_trainer(_cfg(compile=True), tiny_target_dir, data_dir, out, device="cpu", resume=True)
    assert handed == [] and "compile_cache.bin is not loaded" in capsys.readouterr().out
    trusted = _cfg(compile=True, trust_compile_cache=True)
    build_trainer(trusted, tiny_target_dir, data_dir, out, device="cpu", resume=True)
    assert handed == [b"anything a bucket may hold"]


def test_a_non_finite_config_value_is_refused_naming_the_file(tmp_path):
    for text, field in (("optim: {lr: 1.0e+39}", "lr"), ("optim: {weight_decay: .inf}", "weight_decay")):
        path = tmp_path / "c.yaml"
        path.write_text(text + "\n")
        with pytest.raises(ValueError, match=f"(?s)invalid config in {path}.*{field}"):
            resolve_config("default", path)


def test_no_checkpoint_holds_a_non_finite_weight_and_none_such_prunes_a_good_one(
    tmp_path, tiny_target_dir, data_dir
):
    from flashdraft.train.state import NonFiniteError

    out = tmp_path / "run"
    trainer = build_trainer(_cfg(keep_last=1), tiny_target_dir, data_dir, out, device="cpu")
    trainer.train_step()
    good = trainer.save()
    trainer.train_step()
    with torch.no_grad():
        next(trainer.drafter.parameters()).view(-1)[0] = float("inf")  # as an overflowing update leaves it
    with pytest.raises(
        NonFiniteError, match=f"no checkpoint is written; the last checkpoint, all finite: {good}"
    ):
        trainer.save()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["LATEST", good.name]
    assert (out / "checkpoints" / "LATEST").read_text().strip() == good.name


def test_a_run_directory_is_continued_or_replaced_only_when_asked(tmp_path, tiny_target_dir, data_dir):
    out = tmp_path / "run"
    first = build_trainer(_cfg(max_steps=2), tiny_target_dir, data_dir, out, device="cpu")
    first.run()
    with pytest.raises(ValueError, match=f"{out} holds a run .*--resume {out} continues it, --overwrite"):
        build_trainer(_cfg(max_steps=2), tiny_target_dir, data_dir, out, device="cpu")
    again = build_trainer(_cfg(max_steps=1), tiny_target_dir, data_dir, out, device="cpu", overwrite=True)
    again.run()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["LATEST", "step_000001"]


def test_a_resume_refuses_other_data_or_another_target_of_the_same_shape(tmp_path, tiny_target_dir, data_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    t = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu")
    t.run()
    other_data = tmp_path / "other-data"
    save_token_dataset(random_docs([80, 90, 100, 70, 110, 60] * 2, seed=9, prompt_len=10), other_data)
    with pytest.raises(ValueError, match="cannot resume .*: the data is not the one it was trained on"):
        build_trainer(_cfg(), tiny_target_dir, other_data, out, device="cpu", resume=True)
    twin = tmp_path / "twin"  # the same shape and tokenizer, other weights
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(twin)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(twin)
    with pytest.raises(ValueError, match="cannot resume .*: the target is not the one it was trained on"):
        build_trainer(_cfg(), twin, data_dir, out, device="cpu", resume=True)


def test_data_made_for_another_tokenizer_or_vocabulary_is_refused_before_training(
    tmp_path, tiny_target_dir, tiny_tokenizer
):
    from flashdraft.data.prepare import prepare_records
    from flashdraft.demo.tiny import build_tokenizer

    turns = lambda i: [{"role": "user", "content": f"q{i} " * 8}, {"role": "assistant", "content": "a " * 30}]  # noqa: E731
    chats = [{"messages": turns(i)} for i in range(8)]
    other = build_tokenizer(["some other text to learn a vocabulary from " * 50], vocab_size=300)
    prepare_records(chats, other, tmp_path / "other", echo=lambda _: None)
    with pytest.raises(ValueError, match="prepared with .*whose tokenizer differs from the target's"):
        build_trainer(_cfg(), tiny_target_dir, tmp_path / "other", tmp_path / "run", device="cpu")
    big = tmp_path / "big-ids"
    save_token_dataset([{"input_ids": [5] * 40 + [len(tiny_tokenizer) + 7], "loss_mask": [1] * 41}] * 8, big)
    with pytest.raises(ValueError, match=f"token id {len(tiny_tokenizer) + 7} is beyond the target's"):
        build_trainer(_cfg(), tiny_target_dir, big, tmp_path / "run2", device="cpu")
