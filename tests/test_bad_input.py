"""Careless input gets a message naming the file, the option or the field, and a non-zero exit, never a
raw traceback; a damaged checkpoint falls back to the one before it; Ctrl-C saves and says where."""

import errno
import json
import signal

import pytest
import torch
from typer.testing import CliRunner

from flashdraft.cli.main import app
from flashdraft.config import resolve_config
from flashdraft.data.packing import save_token_dataset
from flashdraft.model.checkpoint import latest_checkpoint
from flashdraft.train.build import build_trainer
from flashdraft.train.trainer import Interrupted
from helpers import random_docs, signal_after_step


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data")
    save_token_dataset(random_docs([70, 90, 120, 60, 100, 80] * 2, seed=5, prompt_len=10), path)
    return path


CONFIG = "drafter: {num_layers: 1, num_taps: 2}\ndata: {seq_len: 128, rows_per_batch: 2}\nnum_anchors: 8\n"


def _cfg(**over):
    base = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 4, "log_every": 1}
    return resolve_config("default", **{**base, "drafter.num_layers": 1, "drafter.num_taps": 2, **over})


def _train(*args, config: str = CONFIG, tmp_path=None):
    path = tmp_path / "c.yaml"
    path.write_text(config)
    return CliRunner().invoke(app, ["train", "--config", str(path), "--device", "cpu", *args])


def test_a_wrong_target_a_broken_config_and_a_config_directory_are_named(tmp_path, data_dir):
    run = ["--data", str(data_dir), "--out", str(tmp_path / "r")]
    wrong = _train("--target", str(tmp_path / "no-model"), *run, tmp_path=tmp_path)
    assert wrong.exit_code == 2 and "no-model: not a model transformers can load" in wrong.output
    broken = _train("--target", "x", *run, config="data: {seq_len: [", tmp_path=tmp_path)
    assert broken.exit_code == 2 and "c.yaml: not valid YAML" in broken.output
    folder = CliRunner().invoke(app, ["train", "--config", str(tmp_path), "--target", "x", *run])
    assert folder.exit_code == 2 and "no such config file (a directory)" in folder.output
    twice = _train("--target", "x", *run, config="optim:\n  lr: 1\n  lr: 2\n", tmp_path=tmp_path)
    assert twice.exit_code == 2 and "not valid YAML: 'lr' is given twice (lines 2 and 3)" in twice.output
    code = _train("--target", "x", *run, config="a: !!python/object/apply:os.getpid []", tmp_path=tmp_path)
    assert code.exit_code == 2 and "c.yaml: not valid YAML" in code.output  # a tag that would run code


def test_damaged_shards_and_checkpoints_are_named(tmp_path, tiny_target_dir, data_dir):
    bad_data = tmp_path / "bad-data"
    (bad_data / "shards").mkdir(parents=True)
    (bad_data / "shards" / "state.json").write_text("{")
    result = _train("--target", str(tiny_target_dir), "--data", str(bad_data), "--out", str(tmp_path / "r"),
                    tmp_path=tmp_path)  # fmt: skip
    assert result.exit_code == 2 and "shards: not a readable token dataset" in result.output

    trainer = build_trainer(_cfg(max_steps=1), tiny_target_dir, data_dir, tmp_path / "run", device="cpu")
    trainer.run()
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    (tmp_path / "a-file").write_text("")
    to_file = CliRunner().invoke(app, ["export", str(ckpt), "--out", str(tmp_path / "a-file")])
    assert to_file.exit_code == 2 and "is a file, not a directory" in to_file.output
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short
    export = CliRunner().invoke(app, ["export", str(ckpt), "--out", str(tmp_path / "x")])
    assert export.exit_code == 2 and "model.safetensors: not a readable safetensors file" in export.output
    (ckpt / "env.json").write_text("{")
    doctor = CliRunner().invoke(app, ["doctor", str(tmp_path / "run")])
    assert doctor.exit_code == 2 and "env.json: not valid JSON" in doctor.output


def test_a_resume_falls_back_past_a_damaged_trainer_state(tmp_path, tiny_target_dir, data_dir, capsys):
    out = tmp_path / "run"
    trainer = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu")
    for _ in range(2):
        trainer.train_step()
        trainer.save()
    state = out / "checkpoints" / "step_000002" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:200])
    resumed = build_trainer(_cfg(), tiny_target_dir, data_dir, out, device="cpu", resume=True)
    assert resumed.step == 1
    assert "step_000002/trainer_state.pt is unreadable" in capsys.readouterr().out


def test_a_full_disk_is_named_with_the_last_complete_checkpoint(
    tmp_path, tiny_target_dir, data_dir, monkeypatch
):
    from flashdraft.model import checkpoint

    calls = []

    def full(state, path, **kwargs):
        calls.append(path)
        if len(calls) > 1:  # the first checkpoint fits, the second does not
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return torch_save_file(state, path, **kwargs)

    torch_save_file = checkpoint.save_file
    monkeypatch.setattr(checkpoint, "save_file", full)
    out = tmp_path / "run"
    result = _train("--target", str(tiny_target_dir), "--data", str(data_dir), "--out", str(out),
                    "--max-steps", "2", "--save-every", "1", tmp_path=tmp_path)  # fmt: skip
    assert result.exit_code == 1
    assert "No space left on device" in result.output and "the last complete checkpoint:" in result.output
    assert "step_000001" in result.output and latest_checkpoint(out / "checkpoints").name == "step_000001"


def test_wandb_asked_for_without_wandb_installed_is_refused_before_anything_loads(
    tmp_path, data_dir, monkeypatch
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    result = _train("--target", "x", "--data", str(data_dir), "--out", str(tmp_path / "r"), "--wandb",
                    tmp_path=tmp_path)  # fmt: skip
    assert result.exit_code == 2 and "pip install 'flashdraft[wandb]'" in result.output


def test_eval_refuses_a_drafter_trained_for_another_vocabulary(
    tmp_path, tiny_target_dir, data_dir, monkeypatch
):
    """From the configs, before the target's weights load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import flashdraft.model.target

    trainer = build_trainer(_cfg(max_steps=1), tiny_target_dir, data_dir, tmp_path / "run", device="cpu")
    trainer.run()
    other = tmp_path / "other-target"
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    model.resize_token_embeddings(model.config.vocab_size + 64)
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(other)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    args = ["eval", "--target", str(other), "--drafter", str(ckpt), "--prompts", str(prompts), "--out",
            str(tmp_path / "e.json"), "--device", "cpu"]  # fmt: skip

    def loads(*args, **kwargs):
        raise AssertionError("the target's weights loaded")

    monkeypatch.setattr(flashdraft.model.target, "load_target", loads)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "another target's drafter" in result.output


def test_ctrl_c_stops_after_the_step_saves_and_the_run_resumes(tmp_path, tiny_target_dir, data_dir):
    # SIGINT as an interactive shell leaves it (a script's background job starts with it ignored,
    # which the trainer keeps)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    out = tmp_path / "run"
    trainer = build_trainer(_cfg(max_steps=6), tiny_target_dir, data_dir, out, device="cpu")
    signal_after_step(trainer, 2, signal.SIGINT)
    try:
        with pytest.raises(
            Interrupted, match=f"interrupted after step 2: saved .*step_000002; --resume {out}"
        ):
            trainer.run()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    finally:
        signal.signal(signal.SIGINT, before)
    resumed = build_trainer(_cfg(max_steps=6), tiny_target_dir, data_dir, out, device="cpu", resume=True)
    assert resumed.step == 2
    resumed.run()
    steps = [int(line.split()[1].split("/")[0]) for line in (out / "train.log").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # no line repeated by the resume
    result = json.loads(
        (out / "result.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON")
    )
    assert result["first_loss"] is None and result["steps"] == 6  # the resumed run never saw step 1


def test_running_out_of_device_memory_names_the_rows_and_the_last_checkpoint(
    tmp_path, tiny_target_dir, data_dir, monkeypatch
):
    """The allocator's error becomes one line: the step, the setting that sizes a step's memory, what to
    change, and the checkpoint that is safe; exit 1."""
    from flashdraft.train import trainer as trainer_module

    step = trainer_module.Trainer.train_step

    def short_of_memory(self, timer=trainer_module.NULL_TIMER):
        if self.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB\nmore detail")
        return step(self, timer)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", short_of_memory)
    out = tmp_path / "run"
    result = _train("--target", str(tiny_target_dir), "--data", str(data_dir), "--out", str(out),
                    "--max-steps", "3", "--save-every", "1", tmp_path=tmp_path)  # fmt: skip
    assert result.exit_code == 1
    assert "out of device memory in step 2 with data.rows_per_batch " in result.output
    assert "(CUDA out of memory. Tried to allocate 9.27 GiB): lower data.rows_per_batch" in result.output
    assert f"the last complete checkpoint: {out / 'checkpoints' / 'step_000001'}" in result.output

    def no_room(cfg):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 60.00 GiB\nmore detail")

    monkeypatch.setattr("flashdraft.train.build.build", no_room)
    result = _train("--target", str(tiny_target_dir), "--data", str(data_dir), "--out", str(tmp_path / "b"),
                    tmp_path=tmp_path)  # fmt: skip
    assert result.exit_code == 1 and "out of device memory loading the target and the drafter (CUDA out of " \
        "memory. Tried to allocate 60.00 GiB)" in result.output  # fmt: skip


def test_an_interrupt_that_saves_nothing_still_names_the_last_checkpoint(tmp_path, tiny_target_dir, data_dir,
                                                                         monkeypatch):  # fmt: skip
    """A second Ctrl-C, or Ctrl-C in a run of several ranks (which stops at once): exit 130 and the
    checkpoint a resume would continue from."""
    from flashdraft.train import trainer as trainer_module

    out = tmp_path / "run"
    first = build_trainer(_cfg(max_steps=1), tiny_target_dir, data_dir, out, device="cpu")
    first.run()

    def interrupted(self, progress=None, until=None, deadline=None, started=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module.Trainer, "run", interrupted)
    result = _train("--target", str(tiny_target_dir), "--data", str(data_dir), "--resume", str(out),
                    "--max-steps", "4", tmp_path=tmp_path)  # fmt: skip
    assert result.exit_code == 130
    assert f"the last complete checkpoint: {out / 'checkpoints' / 'step_000001'}" in result.output
