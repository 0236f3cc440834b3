"""`flashdraft bench --shape tiny` runs the real training step on CPU, so the command cannot rot."""

import json

from typer.testing import CliRunner

from flashdraft.bench import shape_config
from flashdraft.cli.main import app
from flashdraft.model.drafter import drafter_config
from flashdraft.train.flops import step_flops


def test_bench_tiny_reports_throughput_mfu_and_phases(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--shape", "tiny", "--seq-len", "128", "--anchors", "8", "--steps", "2", "--warmup", "1"]
    result = CliRunner().invoke(app, [*args, "--device", "cpu", "--no-recompute-logits", "--json", str(out)])
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert r["settings"]["recompute_logits"] is False  # the option reached the trainer
    assert r["ctx_tok_s"] > 0 and r["draft_pos_s"] > 0 and 0 < r["mfu"] < 1
    phases = {"target_forward", "block_mask", "drafter_forward", "loss_forward", "backward", "optimizer"}
    assert phases <= set(r["phases_ms"])


def test_flop_count_of_the_paper_shape_matches_docs_perf():
    """docs/perf.md: about 43 TFLOP of target and 73 of drafter per 3072-token sample."""
    target = shape_config("qwen3-8b")
    drafter = drafter_config(target, 5, None, 5, 16, 151669)
    f = step_flops(target, drafter, 34, 3072, 512 * 16, 512 * 16)
    assert 41e12 < f["target"] < 45e12
    assert 70e12 < f["drafter"] < 76e12
