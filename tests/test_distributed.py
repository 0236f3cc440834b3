"""Layouts on gloo: N processes give the loss curve of one process on the same global batch, whether
the drafter is replicated (DDP) or sharded (--fsdp); checkpoints are the same either way."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from flashdraft.data.packing import save_token_dataset
from flashdraft.model.checkpoint import load_drafter
from helpers import random_docs

pytestmark = pytest.mark.slow

CONFIG = """
data: {seq_len: 128, rows_per_batch: 1}
num_anchors: 8
log_every: 1
save_every: 2
grad_accum: %d
optim: {grad_clip: 0.5}
drafter: {num_layers: 1, num_taps: 2}
"""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data")
    save_token_dataset(random_docs([70, 90, 120, 60, 100, 80] * 4, seed=3, prompt_len=10), path)
    return path


class Run(NamedTuple):
    losses: list[float]
    master: dict  # fp32 weights at the last step
    out: Path
    stdout: str


def _train(tmp_path, target, data, name, grad_accum, *extra) -> Run:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG % grad_accum)
    out = tmp_path / name
    cmd = [sys.executable, "-m", "flashdraft.cli.main", "train", "--target", str(target), "--data",
           str(data), "--out", str(out), "--config", str(cfg), "--max-steps", "3", "--device", "cpu",
           *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    state = torch.load(out / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=True)
    return Run(losses, state["master"], out, proc.stdout)


def _assert_same(a: Run, b: Run):
    """Same losses and final weights; `a` may be a resumed run, which logs only its last steps."""
    assert a.losses == pytest.approx(b.losses[-len(a.losses) :], abs=1e-5)
    for k in b.master:
        torch.testing.assert_close(a.master[k], b.master[k], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir, data_dir) -> dict[str, Run]:
    """The same 3 steps of 4 micro-batches by one process and by 2 colocated ranks with DDP and with FSDP
    (each accumulating 2); the first two validate at the last step (on the training data)."""
    tmp = tmp_path_factory.mktemp("runs")
    val = ("--val-data", str(data_dir))
    return {
        "one": _train(tmp, tiny_target_dir, data_dir, "one", 4, *val),
        "ddp": _train(tmp, tiny_target_dir, data_dir, "ddp", 2, "--nproc", "2", *val),
        "fsdp": _train(tmp, tiny_target_dir, data_dir, "fsdp", 2, "--nproc", "2", "--fsdp"),
    }


def test_colocated_and_split_layouts_match_one_process(tmp_path, tiny_target_dir, data_dir, runs):
    one, colocated = runs["one"], runs["ddp"]
    _assert_same(colocated, one)
    split = _train(tmp_path, tiny_target_dir, data_dir, "split", 2, "--nproc", "3", "--layout", "split:1:2")
    _assert_same(split, colocated)
    metrics = json.loads((tmp_path / "split" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < metrics["target_busy"] <= 1 and 0 < metrics["drafter_busy"] <= 1


def test_validation_split_over_ranks_sums_to_one_process(runs):
    last = {
        k: json.loads((runs[k].out / "metrics.jsonl").read_text().splitlines()[-1]) for k in ("one", "ddp")
    }
    assert last["one"]["val_docs"] == last["ddp"]["val_docs"] > 0
    for key in ("val_loss", "val_acc_slot1", "val_tau_train", "val_tau_walk"):
        assert last["ddp"][key] == pytest.approx(last["one"][key], abs=1e-4), key


def test_a_sharded_drafter_trains_as_a_replicated_one(tmp_path, tiny_target_dir, data_dir, runs):
    shares = re.search(r"this rank holds ([\d,]+) of the drafter's ([\d,]+)", runs["fsdp"].stdout)
    held, total = (int(n.replace(",", "")) for n in shares.groups())
    assert 0 < held < total
    _assert_same(runs["fsdp"], runs["ddp"])
    _assert_same(runs["fsdp"], runs["one"])
    split = _train(
        tmp_path, tiny_target_dir, data_dir, "split", 2, "--nproc", "3", "--layout", "split:1:2", "--fsdp"
    )
    _assert_same(split, runs["ddp"])


def _resume_from(tmp_path, run: Run, name: str) -> Path:
    """A run directory holding only `run`'s step-2 checkpoint, as a run stopped after step 2 leaves it."""
    out = tmp_path / name
    shutil.copytree(run.out / "checkpoints" / "step_000002", out / "checkpoints" / "step_000002")
    (out / "checkpoints" / "LATEST").write_text("step_000002\n")
    return out


def test_fsdp_runs_resume_exactly_and_resume_unsharded_runs(tmp_path, tiny_target_dir, data_dir, runs):
    def resume(ckpt_of: str, name: str, *extra) -> Run:
        out = _resume_from(tmp_path, runs[ckpt_of], name)
        return _train(tmp_path, tiny_target_dir, data_dir, name, *extra, "--resume", str(out))

    fsdp = resume("fsdp", "fsdp_fsdp", 2, "--nproc", "2", "--fsdp")
    assert all(torch.equal(fsdp.master[k], runs["fsdp"].master[k]) for k in runs["fsdp"].master)
    _assert_same(resume("ddp", "ddp_fsdp", 2, "--nproc", "2", "--fsdp"), runs["fsdp"])
    _assert_same(resume("fsdp", "fsdp_one", 4), runs["one"])


def test_an_fsdp_checkpoint_holds_full_tensors_as_a_ddp_one(runs):
    ckpt = {name: runs[name].out / "checkpoints" / "step_000003" for name in ("ddp", "fsdp")}
    drafters = {name: load_drafter(path).state_dict() for name, path in ckpt.items()}
    states = {name: torch.load(path / "trainer_state.pt", weights_only=True) for name, path in ckpt.items()}
    for a, b in [(drafters["ddp"], drafters["fsdp"]), (states["ddp"]["master"], states["fsdp"]["master"])]:
        assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    ddp, fsdp = states["ddp"]["optimizer"], states["fsdp"]["optimizer"]
    assert ddp["param_groups"] == fsdp["param_groups"]
    shapes = lambda o: {i: {k: v.shape for k, v in s.items()} for i, s in o["state"].items()}  # noqa: E731
    assert shapes(ddp) == shapes(fsdp)
    for i, s in ddp["state"].items():
        for k, v in s.items():
            torch.testing.assert_close(fsdp["state"][i][k], v, atol=1e-6, rtol=1e-4)


POISONED = """
import sys
from flashdraft.config import resolve_config
from flashdraft.train.build import build_trainer

target, data, out, cfg = sys.argv[1:]
cfg = resolve_config(yaml_path=cfg, fsdp=True, save_every=1)
trainer = build_trainer(cfg, target, data, out, device="cpu")
get, corrupt = trainer.features.get, trainer.micro_indices(2)  # rank 1's batch of step 2 is corrupt

def poisoned(m, *a):
    batch, feats, *rest = get(m, *a)
    return batch, feats * (float("nan") if trainer.topo.rank == 1 and m in corrupt else 1.0), *rest

trainer.features.get = poisoned
trainer.run()
trainer.close()
"""


def test_a_sharded_step_with_a_non_finite_gradient_is_skipped(tmp_path, tiny_target_dir, data_dir):
    script, cfg, out = tmp_path / "poisoned.py", tmp_path / "cfg.yaml", tmp_path / "run"
    script.write_text(POISONED)
    cfg.write_text(CONFIG % 2 + "max_steps: 3\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(tiny_target_dir), str(data_dir), str(out), str(cfg)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1]
    before, skipped, after = (
        torch.load(out / "checkpoints" / f"step_00000{s}" / "trainer_state.pt", weights_only=True)
        for s in (1, 2, 3)
    )
    assert all(torch.equal(v, before["master"][k]) for k, v in skipped["master"].items())  # step 2: no change
    assert float(skipped["optimizer"]["state"][0]["step"]) == 1  # nor AdamW's step count
    for k, v in after["master"].items():  # and the next step trains on
        assert torch.isfinite(v).all() and not torch.equal(v, skipped["master"][k])


def test_fsdp_with_tau_during_training_is_refused(tmp_path, tiny_target_dir, data_dir):
    from typer.testing import CliRunner

    from flashdraft.cli.main import app

    args = ["train", "--target", str(tiny_target_dir), "--data", str(data_dir), "--out", str(tmp_path / "r")]
    result = CliRunner().invoke(app, [*args, "--fsdp", "--eval-every", "2", "--eval-prompts", "p.jsonl"])
    assert result.exit_code == 2
    assert "eval_every cannot be combined with fsdp" in result.output


def test_fsdp_on_one_drafter_rank_says_it_does_not_shard(tmp_path, tiny_target_dir, data_dir, capsys):
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    cfg = resolve_config("tiny_cpu", fsdp=True, **{"drafter.num_layers": 1, "data.seq_len": 128})
    build_trainer(cfg, tiny_target_dir, data_dir, tmp_path / "r", device="cpu")
    assert "fsdp: one drafter rank, nothing to shard" in capsys.readouterr().out


def test_a_layout_that_does_not_fit_the_world_is_refused(tmp_path, tiny_target_dir, data_dir):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG % 1)
    cmd = [sys.executable, "-m", "flashdraft.cli.main", "train", "--target", str(tiny_target_dir),
           "--data", str(data_dir), "--out", str(tmp_path / "r"), "--config", str(cfg),
           "--layout", "split:2:2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "split:2:2 needs 4 processes" in proc.stderr


def test_plan_prints_roles_memory_and_balance_without_loading_weights(tmp_path):
    from typer.testing import CliRunner

    from flashdraft.bench import shape_config
    from flashdraft.cli.main import app

    shape_config("qwen3-8b").save_pretrained(tmp_path / "qwen3-8b")  # config only, no weights
    args = ["train", "--target", str(tmp_path / "qwen3-8b"), "--data", "unused", "--out", "unused", "--plan"]
    result = CliRunner().invoke(
        app, [*args, "--nproc", "8", "--layout", "split:5:3", "--preset", "qwen3_8b_h200"]
    )
    assert result.exit_code == 0, result.output
    assert "rank 4: target" in result.output and "rank 5: drafter" in result.output
    # 43 TFLOP of target work at 80% of peak over 5 ranks against 72 of drafter work at 57% over 3
    assert "target ranks 26%, drafter ranks 100%" in result.output
    sharded = CliRunner().invoke(
        app, [*args, "--nproc", "8", "--layout", "split:5:3", "--preset", "qwen3_8b_h200", "--fsdp"]
    )
    gib = lambda text: float(re.search(r"drafter ranks ~([\d.]+) GiB", text).group(1))  # noqa: E731
    assert gib(sharded.output) < gib(result.output)  # the drafter's 16 bytes a parameter over 3 ranks
    assert not (tmp_path / "unused").exists()
