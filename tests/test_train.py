"""Training learns, checkpoints are the z-lab layout and reload, and `flashdraft train` runs end to end."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from flashdraft.cli.main import app
from flashdraft.data.packing import save_token_dataset
from flashdraft.model.checkpoint import latest_checkpoint, load_drafter, save_checkpoint
from flashdraft.model.drafter import Visibility
from flashdraft.train.mask import choose_mask_token
from flashdraft.train.step import Kernels, block_visibility, micro_step_loss, plan_micro_batch
from flashdraft.train.trainer import cosine_lr, resolve_attention
from helpers import BLOCK, GAMMA, MASK_ID, packed_batch, random_docs, target_and_drafter


def test_training_on_a_fixed_batch_halves_the_loss():
    torch.manual_seed(0)
    target, drafter = target_and_drafter()
    with (
        torch.no_grad()
    ):  # a random lm_head at init scale (0.02) gives near-flat logits; a trained one doesn't
        target.lm_head.weight.normal_(0.0, 0.5)
    drafter.train()
    batch = packed_batch([[60, 60], [120]], seq_len=128)
    mb = plan_micro_batch(batch, 4, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        out = micro_step_loss(drafter, target, mb, Kernels("dense"))
        loss = out.weighted_ce / mb.blocks.weights.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_target_gets_no_gradient_and_drafter_does():
    target, drafter = target_and_drafter()
    batch = packed_batch([[64]], seq_len=64)
    mb = plan_micro_batch(batch, 4, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0))
    micro_step_loss(drafter, target, mb, Kernels("dense")).weighted_ce.backward()
    assert all(p.grad is None for p in target.model.parameters())
    assert all(p.grad is not None for p in drafter.parameters())


ZLAB_FIELDS = {
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "layer_types",
    "num_target_layers",
    "block_size",
    "dflash_config",
    "torch_dtype",
}


def _zlab_weight_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    return names | {f"layers.{i}.{p}" for i in range(num_layers) for p in per_layer}


def test_checkpoint_is_the_zlab_layout_and_reloads_to_the_same_outputs(tmp_path):
    target, drafter = target_and_drafter()
    path = save_checkpoint(drafter, tmp_path / "checkpoints", step=7)
    assert path.name == "step_000007"
    assert latest_checkpoint(tmp_path / "checkpoints") == path
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((path / "config.json").read_text())
    assert set(cfg) >= ZLAB_FIELDS
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3], "block_size": BLOCK}
    assert cfg["num_target_layers"] == 6 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is False
    weights = load_file(str(path / "model.safetensors"))
    assert set(weights) == _zlab_weight_names(2)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())

    reloaded = load_drafter(path)
    feats = target.features(torch.randint(0, 90, (1, 20)))
    block = target.embed_tokens(torch.full((1, BLOCK), MASK_ID))
    pos = torch.arange(20, 20 + BLOCK)[None]
    ctx_pos = torch.arange(20)[None]
    with torch.no_grad():
        for p in drafter.parameters():  # the checkpoint stores bf16: compare with rounded weights
            p.copy_(p.bfloat16().float())
        a = reloaded(block, pos, reloaded.context_kv(reloaded.fuse(feats), ctx_pos), Visibility(None))
        b = drafter(block, pos, drafter.context_kv(drafter.fuse(feats), ctx_pos), Visibility(None))
    torch.testing.assert_close(a, b)


def test_mask_token_id_resolution(tiny_tokenizer):  # every rule: tests/test_mask_token.py
    mask = choose_mask_token(tiny_tokenizer, len(tiny_tokenizer), None, None)
    assert mask.id == tiny_tokenizer.mask_token_id
    assert choose_mask_token(tiny_tokenizer, 500, 450, None).id == 450
    with pytest.raises(ValueError, match="not a row"):
        choose_mask_token(tiny_tokenizer, 500, 500, None)


def test_cosine_schedule_warms_up_then_decays():
    lrs = [cosine_lr(s, 100, 10, 0.0) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[-1] < 0.01


def test_train_command_writes_a_run_directory(tmp_path, tiny_target_dir, tiny_tokenizer):
    docs = random_docs([70, 90, 120, 60, 100, 80] * 3, seed=3, prompt_len=10)
    for d in docs:  # keep ids inside the tiny tokenizer's vocabulary
        d["input_ids"] = [i % len(tiny_tokenizer) for i in d["input_ids"]]
    save_token_dataset(docs, tmp_path / "data")
    (tmp_path / "cfg.yaml").write_text(
        "data: {seq_len: 128, rows_per_batch: 2}\nnum_anchors: 8\nlog_every: 2\neval_max_new_tokens: 16\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "def main():"}\n{"messages": [{"role": "user", "content": "import os"}]}\n'
    )
    run = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--target", str(tiny_target_dir),
            "--data", str(tmp_path / "data"),
            "--out", str(run),
            "--config", str(tmp_path / "cfg.yaml"),
            "--preset", "tiny_cpu",
            "--max-steps", "4",
            "--save-every", "2",
            "--eval-prompts", str(prompts),
            "--eval-every", "4",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    mask = f"mask token {tiny_tokenizer.mask_token_id} '<|mask|>' (the tokenizer's mask token; drafter.mask"
    assert mask in result.output
    assert (run / "config.yaml").exists() and (run / "train.log").exists()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [2, 4]
    assert {"loss", "acc_slot1", "acc_per_slot", "lr", "ctx_tok_s", "draft_pos_s", "mfu"} <= set(lines[0])
    assert 0.1 < lines[0]["mem_gib"] < 24  # on a CPU, the process's peak resident memory
    assert "tau" not in lines[0] and 1.0 <= lines[1]["tau"] <= 16.0  # serving acceptance, measured at step 4
    assert "tau" in (run / "train.log").read_text()
    ckpts = run / "checkpoints"
    assert (ckpts / "LATEST").read_text().strip() == "step_000004"
    assert (ckpts / "step_000002" / "model.safetensors").exists()
    assert list((run / "tb").iterdir())


def test_a_runs_own_config_yaml_runs_it_again(tmp_path, tiny_target_dir, tiny_tokenizer):
    """RUN/config.yaml holds the whole run (recipe and `run:`); `--config` takes it back as it is and
    the second run trains as the first did."""
    data = _token_data(tmp_path / "data", tiny_tokenizer, [70, 90, 120, 60, 100, 80] * 2, seed=5)
    first = tmp_path / "first"
    args = ["train", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(first)]
    args += ["--preset", "tiny_cpu", "--max-steps", "3", "--seed", "7"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((first / "config.yaml").read_text())
    assert saved["run"]["target"] == str(tiny_target_dir) and saved["record"]["data_dir"] == str(data)
    assert "resume" not in saved["run"] and "overwrite" not in saved["run"]

    again = CliRunner().invoke(app, ["train", "--config", str(first / "config.yaml")])
    assert again.exit_code == 2 and f"{first} holds a run" in again.output  # its own run.out
    second = tmp_path / "second"
    again = CliRunner().invoke(app, ["train", "--config", str(first / "config.yaml"), "--out", str(second)])
    assert again.exit_code == 0, again.output
    resaved = yaml.safe_load((second / "config.yaml").read_text())
    assert resaved["run"].pop("out") == str(second) and saved["run"].pop("out") == str(first)
    assert resaved == saved

    from safetensors.torch import load_file

    def weights(run):
        return load_file(run / "checkpoints" / "step_000003" / "model.safetensors")

    a, b = weights(first), weights(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # --resume RUN alone continues it as it was configured (its preset, seed, target and data)
    more = CliRunner().invoke(app, ["train", "--resume", str(first), "--max-steps", "5"])
    assert more.exit_code == 0, more.output
    assert (first / "checkpoints" / "LATEST").read_text().strip() == "step_000005"
    assert yaml.safe_load((first / "config.yaml").read_text())["seed"] == 7


def test_init_from_starts_from_the_source_drafter_and_refuses_one_that_does_not_fit(
    tmp_path, tiny_target_dir, tiny_tokenizer
):
    """--init-from DIR: the run's drafter before its first step is DIR's drafter as `flashdraft eval`
    loads it (shape and weights); a drafter setting that differs from DIR, or a drafter made for
    another target, is refused before the target's weights load."""
    import shutil

    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    data = _token_data(tmp_path / "data", tiny_tokenizer, [70, 90, 120, 60, 100, 80] * 2, seed=8)
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 2}
    source = build_trainer(resolve_config("tiny_cpu", **over), tiny_target_dir, data, tmp_path / "a", "cpu")
    source.run()
    ckpt = latest_checkpoint(tmp_path / "a" / "checkpoints")

    cfg = resolve_config("finetune", **over, init_from=str(ckpt))
    tuned = build_trainer(cfg, tiny_target_dir, data, tmp_path / "b", "cpu")
    loaded = load_drafter(ckpt)
    assert tuned.drafter.config.num_hidden_layers == 2 and tuned.cfg.drafter.num_layers == 2
    assert tuned.cfg.drafter.target_layer_ids == loaded.target_layer_ids == source.drafter.target_layer_ids
    mine = tuned.drafter.state_dict()
    assert mine.keys() == loaded.state_dict().keys()
    assert all(torch.equal(mine[k], v) for k, v in loaded.state_dict().items())
    assert tuned.cfg.optim.lr == 6e-5
    tuned.run()  # and it trains

    three = resolve_config("finetune", **over, init_from=str(ckpt), **{"drafter.num_layers": 3})
    with pytest.raises(ValueError, match=r"drafter.num_layers: 3 here, 2 in"):
        build_trainer(three, tiny_target_dir, data, tmp_path / "c", "cpu")
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    raw = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(raw | {"num_target_layers": 12}))
    with pytest.raises(ValueError, match=r"another target: num_target_layers 12 \(the target's: 6\)"):
        build_trainer(resolve_config("finetune", **over, init_from=str(other)), tiny_target_dir, data,
                      tmp_path / "d", "cpu")  # fmt: skip
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_a_drafter_with_sliding_window_layers_trains_and_saves_them(
    tmp_path, tiny_target_dir, tiny_tokenizer
):
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    data = _token_data(tmp_path / "data", tiny_tokenizer, [70, 90, 120, 60] * 2, seed=10)
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 2}
    types = {"drafter.layer_types": ["sliding_attention", "full_attention"], "drafter.sliding_window": 16}
    trainer = build_trainer(
        resolve_config("tiny_cpu", **over, **types), tiny_target_dir, data, tmp_path / "r", "cpu"
    )
    result = trainer.run()
    loaded = load_drafter(result.checkpoint)
    assert loaded.layer_types == ["sliding_attention", "full_attention"] and loaded.sliding_window == 16
    config = json.loads((result.checkpoint / "config.json").read_text())
    assert config["layer_types"] == loaded.layer_types and config["sliding_window"] == 16
    for bad, message in [
        ({"drafter.layer_types": ["sliding_attention"]}, "has 1 entries for 2 layers"),
        ({"drafter.layer_types": ["sliding_attention", "full_attention"]}, "set drafter.sliding_window"),
        ({"drafter.sliding_window": 16}, "no drafter.layer_types entry is sliding"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_config("tiny_cpu", **bad)


def test_train_shows_only_its_own_progress_and_no_deprecation_warning(
    tmp_path, tiny_target_dir, tiny_tokenizer
):
    """transformers' and datasets' bars are off unless --verbose; our forwards use the cache argument
    the installed transformers names (5.24 deprecated `past_key_values`)."""
    import warnings

    import datasets
    import transformers

    from flashdraft.model.target import Target

    data = _token_data(tmp_path / "data", tiny_tokenizer, [70, 90, 120, 60] * 2, seed=6)
    args = ["train", "--target", str(tiny_target_dir), "--data", str(data), "--preset", "tiny_cpu"]
    args += ["--max-steps", "1"]
    shown = {}
    for flags in (["--verbose"], []):
        transformers.utils.logging.enable_progress_bar(), datasets.enable_progress_bars()
        result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / f"run{len(flags)}"), *flags])
        assert result.exit_code == 0, result.output
        shown[len(flags)] = "Loading weights" in result.output
    transformers.utils.logging.enable_progress_bar(), datasets.enable_progress_bars()
    assert shown == {1: True, 0: False}

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    target = Target(model, [1, 3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.decode(torch.tensor([[5, 6, 7]]), transformers.DynamicCache(config=model.config))
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--layout", "split:x"], "layout 'split:x': expected 'colocated' or 'split:T:D'"),
        (["--layout", "split:1:1", "--eval-every", "2", "--eval-prompts", "p.jsonl"], "eval_every needs the"),
        (["--device", "gpu"], "run.device"),
    ],
)
def test_a_run_setting_is_checked_before_anything_loads(tmp_path, options, message):
    """The target named does not exist: each error is the config's own, found before loading it."""
    args = [
        "train",
        "--target",
        str(tmp_path / "nothing"),
        "--data",
        str(tmp_path),
        "--out",
        str(tmp_path / "r"),
    ]
    result = CliRunner().invoke(app, [*args, *options])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "nothing" not in result.output and not (tmp_path / "r").exists()


def _token_data(path, tokenizer, lengths, seed):
    docs = random_docs(lengths, seed=seed, prompt_len=10)
    for d in docs:  # keep ids inside the tiny tokenizer's vocabulary
        d["input_ids"] = [i % len(tokenizer) for i in d["input_ids"]]
    save_token_dataset(docs, path)
    return path


def test_validation_measures_held_out_data_and_trains_nothing(tmp_path, tiny_target_dir, tiny_tokenizer):
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    train = _token_data(tmp_path / "train", tiny_tokenizer, [70, 90, 120, 60, 100, 80] * 3, seed=3)
    held = _token_data(tmp_path / "held", tiny_tokenizer, [80, 110, 60, 90] * 3, seed=4)

    def trainer(val_data, out):
        over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "log_every": 2}
        cfg = resolve_config("tiny_cpu", None, max_steps=4, val_data=str(val_data), val_every=2, **over)
        return build_trainer(cfg, str(tiny_target_dir), str(train), str(tmp_path / out), "cpu")

    t = trainer(held, "run")
    before = {k: v.clone() for k, v in t.drafter.state_dict().items()}
    first, again = t.validate(), t.validate()
    first.pop("val_s"), again.pop("val_s")
    assert first == again  # the same batches and anchors every time
    assert {"val_loss", "val_acc_slot1", "val_acc_per_slot", "val_tau_train"} <= set(first)
    assert "val_grad_norm" not in first and first["val_docs"] > 0
    assert 1.0 <= first["val_tau_walk"] <= BLOCK
    assert all(torch.equal(v, before[k]) for k, v in t.drafter.state_dict().items())
    assert all(p.grad is None for p in t.drafter.parameters()) and not t.optimizer.state
    on_train = trainer(train, "run2").validate()  # same weights (same seed), other data
    assert on_train["val_loss"] != first["val_loss"]

    t.run()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [2, 4]
    assert all("val_loss" in m and 1.0 <= m["val_tau_train"] <= BLOCK for m in lines)
    assert lines[-1]["val_loss"] != first["val_loss"]  # measured on the trained weights


@pytest.mark.parametrize(
    "over, message",
    [
        ({"val_every": 2}, "val_every needs val_data"),
        ({"val_every": 2, "val_data": "v", "fsdp": True}, "val_every cannot be combined with fsdp"),
    ],
)
def test_validation_options_are_checked(over, message):
    from flashdraft.config import resolve_config

    with pytest.raises(ValueError, match=message):
        resolve_config("tiny_cpu", None, **over)


def test_an_override_leaves_the_preset_as_it_was():
    """A dotted override once changed the preset's nested mapping in place, so every later run of the
    process got it too (a 1-layer tiny_cpu drafter after one test asked for one)."""
    from flashdraft.config import resolve_config

    assert resolve_config("tiny_cpu", **{"drafter.num_layers": 1, "optim.lr": 1.0}).drafter.num_layers == 1
    again = resolve_config("tiny_cpu")
    assert again.drafter.num_layers == 2 and again.optim.lr == 3e-3


def test_train_command_rejects_a_bad_config(tmp_path, tiny_target_dir):
    (tmp_path / "cfg.yaml").write_text("optim: {lr: -1}\n")
    result = CliRunner().invoke(
        app,
        ["train", "--target", str(tiny_target_dir), "--data", str(tmp_path), "--out", str(tmp_path / "r"),
         "--config", str(tmp_path / "cfg.yaml")],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "cfg.yaml" in result.output and "lr" in result.output


def test_wandb_logging_is_offline_unless_configured(tmp_path, monkeypatch):
    """--wandb goes through wandb's own API, offline by default; the fake records what it was given."""
    import sys
    import types

    calls = {}

    class Run:
        def log(self, data, step):
            calls.setdefault("log", []).append((step, data))

        def finish(self):
            calls["finished"] = True

    fake = types.SimpleNamespace(init=lambda **kw: calls.update(init=kw) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    from flashdraft.train.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, wandb_config={"seed": 0})
    m = {"step": 1, "loss": 2.5, "acc_slot1": 0.5, "acc_mean": 0.4, "tau_train": 1.5}
    m |= {"lr": 1e-3, "ctx_tok_s": 10.0}
    log.log({**m, "draft_pos_s": 5.0, "acc_per_slot": [0.5]})
    log.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["config"] == {"seed": 0}
    assert calls["log"] == [
        (1, {f"train/{k}": v for k, v in m.items() if k != "step"} | {"train/draft_pos_s": 5.0})
    ]
    assert calls["finished"]
    monkeypatch.setenv("WANDB_MODE", "online")
    MetricsLogger(tmp_path, total_steps=2, tensorboard=False, wandb_config={}).close()
    assert calls["init"]["mode"] == "online"


def test_attention_is_flex_on_a_gpu_dense_on_a_cpu_and_a_flex_head_below_16_is_refused():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert (resolve_attention("auto", cuda, 128), resolve_attention("auto", cpu, 8)) == ("flex", "dense")
    with pytest.raises(ValueError, match="no CPU backward"):
        resolve_attention("flex", cpu, 128)
    with pytest.raises(ValueError, match="head size of at least 16, the drafter's is 8"):  # seen on the H200
        resolve_attention("auto", cuda, 8)


def _four_step_run(tmp_path, tiny_target_dir, tiny_tokenizer):
    """`flashdraft train` arguments of a 4-step CPU run on small data, and its run directory."""
    data = _token_data(tmp_path / "data", tiny_tokenizer, [70, 90, 120, 60, 100, 80] * 2, seed=5)
    args = ["train", "--target", str(tiny_target_dir), "--data", str(data), "--preset", "tiny_cpu"]
    return [*args, "--max-steps", "4"], tmp_path / "run"


def test_train_until_stops_with_a_checkpoint_that_resume_continues(tmp_path, tiny_target_dir, tiny_tokenizer):
    args, run = _four_step_run(tmp_path, tiny_target_dir, tiny_tokenizer)
    first = CliRunner().invoke(app, [*args, "--out", str(run), "--until", "2"])
    assert first.exit_code == 0, first.output
    assert "stopped at step 2 of 4 (--until)" in first.output and f"--resume {run} continues" in first.output
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step_000002"
    late = CliRunner().invoke(app, [*args, "--resume", str(run), "--until", "2"])
    assert late.exit_code == 2 and "--until 2: the run is at step 2 of 4" in late.output
    rest = CliRunner().invoke(app, [*args, "--resume", str(run)])
    assert rest.exit_code == 0 and "done: 4 steps" in rest.output, rest.output


def test_train_max_minutes_stops_on_the_clock_with_a_checkpoint_that_resume_continues(
    tmp_path, tiny_target_dir, tiny_tokenizer
):
    """--max-minutes 0: the deadline has passed when the first step ends, so the run stops there, saved."""
    args, run = _four_step_run(tmp_path, tiny_target_dir, tiny_tokenizer)
    first = CliRunner().invoke(app, [*args, "--out", str(run), "--max-minutes", "0"])
    assert first.exit_code == 0, first.output
    assert "stopped at step 1 of 4 (--max-minutes)" in first.output
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step_000001"
    rest = CliRunner().invoke(app, [*args, "--resume", str(run), "--max-minutes", "60"])
    assert rest.exit_code == 0 and "done: 4 steps" in rest.output, rest.output


@pytest.mark.parametrize(
    "over, loaded",
    [({}, "last tap"), ({"distill": 0.5}, "all"), ({"drafter.target_layer_ids": [0, 2]}, "last tap")],
)
def test_a_run_loads_the_target_layers_it_runs(tmp_path, tiny_target_dir, tiny_tokenizer, over, loaded):
    """Features stop at the last tap, so a run loads the target up to it; distillation (the final hidden
    state) loads every layer. The checkpoint records the whole target's depth either way."""
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    data = _token_data(tmp_path / "data", tiny_tokenizer, [70, 90, 120, 60] * 2, seed=5)
    cfg = resolve_config("tiny_cpu", **{"max_steps": 1, "drafter.num_taps": 2, **over})
    trainer = build_trainer(cfg, tiny_target_dir, data, tmp_path / "run", device="cpu")
    ids = trainer.drafter.target_layer_ids
    expected = max(ids) + 1 if loaded == "last tap" else 6
    assert trainer.target.loaded_layers == expected and trainer.target.num_layers == 6
    result = trainer.run()
    assert json.loads((result.checkpoint / "config.json").read_text())["num_target_layers"] == 6
    trainer.close()


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_a_step_clips_the_gradients_as_clip_grad_norm_does(tmp_path, tiny_target_dir, token_data_dir):
    """The trainer clips inside fused AdamW (its grad_scale): two steps whose gradients the clip scales
    down update the weights as clip_grad_norm_ followed by AdamW does. (Adam's first step hardly depends
    on the gradient's scale; the second does, through the moments of both.)"""
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    over = {"max_steps": 2, "drafter.num_layers": 1, "optim.grad_clip": 1e-3, "optim.warmup_ratio": 0.0}
    cfg = resolve_config("tiny_cpu", **over)
    trainer = build_trainer(cfg, tiny_target_dir, token_data_dir, tmp_path / "run", device="cpu")
    params = list(trainer.drafter.parameters())
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    group = {
        k: v for k, v in trainer.optimizer.param_groups[0].items() if k in ("betas", "eps", "weight_decay")
    }
    ref_optimizer = torch.optim.AdamW(reference, lr=1.0, **group)
    ref_norms = []
    trainer_step = trainer.optimizer.step

    def both_steps():
        for r, p in zip(reference, params, strict=True):
            r.grad = p.grad.clone()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference, cfg.optim.grad_clip))
        ref_optimizer.param_groups[0]["lr"] = trainer.optimizer.param_groups[0]["lr"]
        assert ref_optimizer.param_groups[0]["lr"] > 0
        ref_optimizer.step()
        trainer_step()

    trainer.optimizer.step = both_steps
    norms = [trainer.train_step().grad_norm for _ in range(2)]
    assert all(n > 100 * cfg.optim.grad_clip for n in ref_norms)  # the clip binds
    torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms))
    for r, p in zip(reference, params, strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-7)
    trainer.close()


def _dense(mask) -> torch.Tensor:
    return mask.to_dense() if hasattr(mask, "to_dense") else mask


@pytest.mark.parametrize("device", ["cpu"] + ["cuda"] * torch.cuda.is_available())
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_next_steps_target_forward_runs_at_the_end_of_a_step_and_changes_nothing(
    tmp_path, tiny_target_dir, token_data_dir, grad_accum, device
):
    """Each step ends with the target forward of the next step's first micro-batch (on a GPU beside the
    optimizer, on a stream of its own): every micro-batch goes through the target once, the last step
    fetches nothing, and the weights and losses equal those of steps that fetch their own, one thing
    after another on one stream."""
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    over = {"max_steps": 3, "drafter.num_layers": 1, "grad_accum": grad_accum}
    cfg = resolve_config("tiny_cpu", **over)
    runs = {}
    for prefetch in (True, False):
        trainer = build_trainer(
            cfg, tiny_target_dir, token_data_dir, tmp_path / f"run{prefetch}", device=device
        )
        assert (trainer.update_stream is not None) == (device == "cuda")
        if not prefetch:
            trainer.prefetch, trainer.update_stream = False, None
        fetched = []
        get = trainer.features.get
        trainer.features.get = lambda m, *a, get=get, fetched=fetched: fetched.append(m) or get(m, *a)
        losses = []
        for step in range(1, 4):
            losses.append(trainer.train_step().loss_sum.clone())
            expected = trainer.micro_indices(step + 1)[0] if prefetch and step < 3 else None
            assert (trainer.ahead[0] if trainer.ahead else None) == expected
            if expected is not None:  # its block mask was built ahead too, for that micro-batch
                mb = trainer.ahead[1][0]
                fresh = block_visibility(trainer.drafter, mb, trainer.spec.kernels)
                assert torch.equal(_dense(mb.visibility.mask), _dense(fresh.mask))
        assert fetched == list(range(3 * grad_accum))
        runs[prefetch] = losses, [p.detach().clone() for p in trainer.drafter.parameters()]
        trainer.close()
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(torch.stack(runs[True][0]), torch.stack(runs[False][0]))
