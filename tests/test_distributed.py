"""Layouts on gloo: N processes give the loss curve of one process on the same global batch."""

import json
import subprocess
import sys

import pytest
import torch

from flashdraft.data.packing import save_token_dataset
from helpers import random_docs

pytestmark = pytest.mark.slow

CONFIG = """
data: {seq_len: 128, rows_per_batch: 1}
num_anchors: 8
log_every: 1
grad_accum: %d
drafter: {num_layers: 1, num_taps: 2}
"""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data")
    save_token_dataset(random_docs([70, 90, 120, 60, 100, 80] * 4, seed=3, prompt_len=10), path)
    return path


def _train(tmp_path, target, data, name, grad_accum, *extra) -> tuple[list[float], dict]:
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
    return losses, state["master"]


def _assert_same(a, b):
    assert a[0] == pytest.approx(b[0], abs=1e-5)
    for k in a[1]:
        torch.testing.assert_close(a[1][k], b[1][k], atol=1e-5, rtol=1e-4)


def test_colocated_and_split_layouts_match_one_process(tmp_path, tiny_target_dir, data_dir):
    one = _train(tmp_path, tiny_target_dir, data_dir, "one", 2)
    colocated = _train(tmp_path, tiny_target_dir, data_dir, "colocated", 1, "--nproc", "2")
    _assert_same(colocated, one)
    split = _train(tmp_path, tiny_target_dir, data_dir, "split", 1, "--nproc", "3", "--layout", "split:1:2")
    _assert_same(split, colocated)
    metrics = json.loads((tmp_path / "split" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < metrics["target_busy"] <= 1 and 0 < metrics["drafter_busy"] <= 1


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
    # 43 TFLOP of target work over 5 ranks against 72 of drafter work over 3: targets idle 2/3 of the time
    assert "target ranks 36%, drafter ranks 100%" in result.output
    assert not (tmp_path / "unused").exists()
