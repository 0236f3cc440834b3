"""`flashdraft bench`: training throughput of a named target shape on random weights.

Builds the target and the paper's drafter with random bf16 weights (nothing downloaded), runs real
training steps through the Trainer (the code path of `flashdraft train`), measures the bf16 matmul
rate in the same process, and reports median step time, context tokens/s, draft positions/s, model
TFLOP/s, MFU, peak memory and a per-phase breakdown. FLOPs are model FLOPs (what the math needs),
counted as in docs/perf.md.

`profile`: after the measured steps, PROFILED_STEPS more run under torch.profiler; DIR/trace.json.gz is
the Chrome trace (each phase a named range) and DIR/ops.txt the ops by device time with their input
shapes (a matmul's shape tells its rate), for the question the phase table leaves open: which kernels.
DIR/phases.txt splits them by phase: each phase's time on the device (on a CPU, its time), how much of
it kernels filled (the rest is the device waiting on the host), and its kernels (on a CPU, its outermost
operators) by time a step.
"""

from __future__ import annotations

import bisect
import gzip
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from flashdraft.config import TrainConfig, resolve_config, run_config
from flashdraft.data.packing import PackedBatch
from flashdraft.model.target import first_layers_config
from flashdraft.train.build import Batches, RunSource, build
from flashdraft.train.flops import matmul_tflops, mfu, micro_batch_flops, sync
from flashdraft.train.metrics import peak_memory_bytes
from flashdraft.train.timing import PhaseTimer
from flashdraft.train.trainer import Trainer

QWEN3_VOCAB = 151936
QWEN3_MASK_ID = 151669
_QWEN3 = dict(
    model_type="qwen3",
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)

# Published shapes (config.json of the releases); "tiny" and "proof-95m" are ours.
SHAPES: dict[str, dict] = {
    "tiny": dict(_QWEN3, hidden_size=64, intermediate_size=192, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False),
    # the target experiments/scratch_target/proof.py trains (experiments/scratch_target/flow.py's H200)
    "proof-95m": dict(_QWEN3, hidden_size=768, intermediate_size=2304, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=8192,
                      tie_word_embeddings=False),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=QWEN3_VOCAB,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=QWEN3_VOCAB,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=QWEN3_VOCAB,
                     tie_word_embeddings=False),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token
    "qwen3-30b-a3b": dict(_QWEN3, model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=QWEN3_VOCAB, tie_word_embeddings=False, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[]),
    # Llama-3.1-8B: 128,256-token vocabulary, Llama 3 RoPE scaling
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                      rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    # gpt-oss-20b: 32 experts of 2,880, 4 per token; sliding-window (128) and full layers alternate,
    # attention sinks (eager attention: transformers refuses sdpa for it), YaRN RoPE, 201,088-token vocab
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, rms_norm_eps=1e-5,
                        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=True,
                        swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                        "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096}),
    # SmolLM2-135M-Instruct, the target of the SmolLM2 proof (experiments/smollm2/proof.py); tied embeddings
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    # Gemma 3 270M, the base model of the Gemma 3 proof: every sixth layer full attention, the rest a
    # 512-token sliding window; one key/value head of 256; a 262,144-token vocabulary; tied embeddings
    "gemma3-270m": dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048,
                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512, rms_norm_eps=1e-6,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
                        max_position_embeddings=32768, tie_word_embeddings=True,
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # Qwen3-32B, and the targets a sharded target is for (`flashdraft train --plan --target-parallel`)
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=QWEN3_VOCAB,
                      tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                       rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}),
    "qwen3-235b-a22b": dict(_QWEN3, model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            vocab_size=QWEN3_VOCAB, tie_word_embeddings=False, moe_intermediate_size=1536,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[]),
}  # fmt: skip


# Rows per step when --rows-per-batch is not given: measured on one H200 (docs/results.md),
# the most throughput within memory that leaves room for real data: qwen3-8b 1 -> 2 rows 66.3 -> 70.3%
# MFU (44.8 GiB), llama3-8b 70.1% at 2 (46.3 GiB); the MoE target's grouped expert GEMMs grow with the
# tokens a step: its forward at 43% of peak at 1 row, 49% at 2, 51% at 4 (81.4 GiB).
DEFAULT_ROWS = {"qwen3-8b": 2, "llama3-8b": 2, "qwen3-30b-a3b": 4}


def shape_config(name: str) -> PretrainedConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {sorted(SHAPES)}")
    fields = dict(SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_target(
    cfg: PretrainedConfig, device: torch.device, dtype: torch.dtype, attention: str = "auto"
) -> PreTrainedModel:
    """Random weights (never zeros: timing on zeros flatters the hardware). attention: as `load_target`'s,
    "auto" the model's own choice, any other name required as given."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    kwargs = {} if attention == "auto" else {"attn_implementation": attention}
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, **kwargs)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


# `build` wants a run directory; the bench saves nothing, so nothing is written there
_UNUSED_OUT = str(Path(tempfile.gettempdir()) / "flashdraft-bench-writes-nothing")


def shape_source(shape: str, tcfg: PretrainedConfig, documents: int = 1) -> RunSource:
    """Random weights of `tcfg` (bf16 on a GPU) and synthetic batches of `documents` per row: what the
    bench trains on."""

    def load(layers, device, attention):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        config = tcfg if layers is None else first_layers_config(tcfg, layers)
        return random_target(config, device, dtype, attention), None

    def batches(cfg, model, tokenizer, packing):
        return Batches(SyntheticStream(cfg, tcfg.vocab_size, documents), None, {})

    def record(model):
        return {"name_or_path": f"shape:{shape}", "architectures": [type(model).__name__]}

    return RunSource(tcfg, load, batches, record)


DEFAULT_DOCUMENTS = 6  # a row of real data packs about six documents (docs/results.md)


class SyntheticStream:
    """Micro-batch m: rows of `documents` random documents of equal length laid end to end (the last one
    takes the remainder), the first 10% of each a prompt. One document a row runs the target's plain
    causal kernel; several run what packed real data runs, the masks that keep documents apart."""

    def __init__(self, cfg: TrainConfig, vocab: int, documents: int = 1):
        self.rows, self.seq_len, self.vocab = cfg.data.rows_per_batch, cfg.data.seq_len, vocab
        if not 1 <= documents <= self.seq_len // 32:
            raise ValueError(
                f"documents: 1 to {self.seq_len // 32} a row of {self.seq_len} tokens, not {documents}"
            )
        length = self.seq_len // documents
        lengths = [length] * (documents - 1) + [self.seq_len - length * (documents - 1)]
        self.doc_ids = torch.repeat_interleave(torch.arange(documents), torch.tensor(lengths))
        self.positions = torch.cat([torch.arange(n) for n in lengths])
        self.prompt = torch.cat([torch.arange(n) < n // 10 for n in lengths])

    def __len__(self) -> int:
        return 2**31  # endless: the run's length is its max_steps

    def upto(self, limit: int) -> int:
        return min(len(self), limit)

    def __getitem__(self, m: int) -> PackedBatch:
        b, s = self.rows, self.seq_len
        ids = torch.randint(0, self.vocab, (b, s), generator=torch.Generator().manual_seed(m))
        mask = (~self.prompt).long().expand(b, s).clone()
        pos = self.positions.expand(b, s).clone()
        return PackedBatch(ids, mask, pos, self.doc_ids.expand(b, s).clone())


@dataclass
class BenchResult:
    shape: str
    device: str
    torch: str
    seq_len: int
    rows_per_batch: int
    documents: int  # per row, counted in the rows trained on
    anchors: int
    block_size: int
    step_ms: float
    ctx_tok_s: float
    draft_pos_s: float
    model_tflops: float
    matmul_tflops: float
    mfu: float  # the FP8 target's linears at the FP8 rate (fp8_matmul_tflops), the rest at the bf16 rate
    peak_mem_gib: float
    startup_s: float
    first_step_s: float
    phases_ms: dict
    first_step_phases_ms: dict
    compile_report: str
    steps: int
    settings: dict  # what the trainer ran with (read back from its config, not from the arguments)
    layout: str = "colocated"
    world_size: int = 1
    drafter_busy: float | None = None  # split layouts: 1 - the longest wait for features / wall
    target_busy: float | None = None  # split layouts: as the target ranks reported it
    ranks: list = field(default_factory=list)  # per rank: role, peak memory, start-up, compile
    fp8_matmul_tflops: float | None = None  # with target_fp8: the FP8 rate, measured in the same run
    # the target forward phase's model FLOPs over its median time, as a fraction of the same rates as mfu
    # (None where the drafter ranks do not run the target: split layouts)
    target_forward_mfu: float | None = None
    compile_seconds: dict = field(default_factory=dict)  # compile_seconds(): where the warm-up's time went
    # each measured step's training loss (weighted CE over the step's weight sum): the seeds fix the
    # weights and batches, so two revisions' runs of one shape train alike unless their numerics differ
    losses: list = field(default_factory=list)


def run_bench(
    shape: str,
    seq_len: int = 3072,
    anchors: int = 512,
    block_size: int = 16,
    rows_per_batch: int | None = None,
    steps: int = 10,
    warmup: int = 3,
    drafter_layers: int = 5,
    device: str | None = None,
    recompute_logits: bool = False,
    compile: bool | None = None,
    compile_target: bool | None = None,
    layout: str = "colocated",
    target_fp8: bool = False,
    profile: Path | None = None,
    target_attention: str = "auto",
    target_experts: str = "auto",
    documents: int | None = None,
    architecture: str = "dflash",
    bf16_weights: bool | None = None,
) -> BenchResult | None:
    """One process, or one rank of `flashdraft bench --nproc N` (under torchrun): every rank runs
    this; the main rank returns the result (throughput summed over drafter ranks, MFU over every
    GPU of the world), the others None."""
    t_start = time.perf_counter()
    tcfg = shape_config(shape)
    rows_per_batch = DEFAULT_ROWS.get(shape, 1) if rows_per_batch is None else rows_per_batch
    cfg = resolve_config(
        "default",
        **{
            "data.seq_len": seq_len,
            "data.rows_per_batch": rows_per_batch,
            "num_anchors": anchors,
            "drafter.block_size": block_size,
            "drafter.num_layers": drafter_layers,
            "drafter.architecture": architecture,
            "drafter.num_taps": min(5, tcfg.num_hidden_layers - 3),
            "max_steps": warmup + steps,
            "recompute_logits": recompute_logits,
            "compile": compile,
            "compile_target": compile_target,
            "target_fp8": target_fp8,
            "target_attention": target_attention,
            "target_experts": target_experts,
            "bf16_weights": bf16_weights,
            "drafter.mask_token_id": QWEN3_MASK_ID if tcfg.vocab_size == QWEN3_VOCAB else tcfg.vocab_size - 1,
        },
    )
    run = {"target": f"shape:{shape}", "data": "synthetic", "out": _UNUSED_OUT, "layout": layout}
    config = run_config(cfg, **run, device=device)
    if documents is None:  # real data's shape, as far as the row holds documents of 32 tokens or more
        documents = min(DEFAULT_DOCUMENTS, seq_len // 32)
    trainer = build(config, shape_source(shape, tcfg, documents))  # as `flashdraft train` builds a run
    documents = int(trainer.stream[0].doc_ids[0].max()) + 1  # what the rows hold, read back
    topo, dev = trainer.topo, trainer.device
    dcfg = trainer.drafter.config
    kept = max(dcfg.target_layer_ids) + 1
    peak = matmul_tflops(dev) if topo.is_main else 0.0  # the rates the result uses
    fp8_peak = matmul_tflops(dev, fp8=True) if topo.is_main and target_fp8 else None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    startup = time.perf_counter() - t_start
    try:
        if profile is not None and topo.world_size > 1:
            raise ValueError("profile: one process only (the other ranks would not take its steps)")
        if not topo.is_drafter:
            trainer.serve(cfg.max_steps)
            topo.gather_objects(_rank_info(topo, dev, startup, None))
            return None
        r = _drafter_bench(trainer, dev, steps, warmup, profile)
        ranks = topo.gather_objects(_rank_info(topo, dev, startup, r["first_step"], trainer.compile_report))
    finally:
        trainer.close()
    if not topo.is_main:
        return None
    first_step, first_phases, times, positions, phases, losses = (
        r[k] for k in ("first_step", "first_phases", "times", "positions", "phases", "losses")
    )
    drafters = topo.num_drafters
    step_s = statistics.median(times)
    pos_per_row = statistics.median(positions) / rows_per_batch
    # model FLOPs count every query position computed (n*B per row), as the kernels do
    flops = {k: v * drafters for k, v in micro_batch_flops(trainer.cfg, tcfg, dcfg, documents).items()}
    tflops = flops["total"] / step_s / 1e12
    phases_ms = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    target_s = phases_ms.get("target_forward", 0.0) / 1000
    # per drafter rank: the target forward's FLOPs (its FP8 share at the FP8 rate) over its own time
    target_flops = {"total": flops["target"] / drafters, "fp8": flops["fp8"] / drafters}
    target_mfu = mfu(target_flops, target_s, peak, fp8_peak) if target_s else None
    return BenchResult(
        shape=shape,
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        torch=torch.__version__,
        seq_len=seq_len,
        rows_per_batch=rows_per_batch,
        documents=documents,
        anchors=anchors,
        block_size=block_size,
        step_ms=1000 * step_s,
        ctx_tok_s=seq_len * rows_per_batch * drafters / step_s,
        draft_pos_s=pos_per_row * rows_per_batch * drafters / step_s,
        model_tflops=tflops,
        matmul_tflops=peak,
        mfu=mfu(flops, step_s, peak, fp8_peak, topo.world_size),
        fp8_matmul_tflops=fp8_peak,
        peak_mem_gib=max(x["peak_mem_gib"] for x in ranks),
        startup_s=startup,
        first_step_s=first_step,
        phases_ms=phases_ms,
        target_forward_mfu=target_mfu,
        first_step_phases_ms=first_phases,
        compile_report=trainer.compile_report.line() if trainer.compile_report else "not compiled",
        compile_seconds=compile_seconds(),
        losses=losses,
        steps=steps,
        settings={
            "recompute_logits": trainer.cfg.recompute_logits,
            "compiled": trainer.compiled,
            "compile_target": trainer.compile_target,
            "target_fp8": trainer.cfg.target_fp8,
            "bf16_weights": bool(trainer.bf16_linears),
            "attention": trainer.attention,
            "target_attention": trainer.target.config._attn_implementation,
            "experts": _experts(trainer.target.config),
            "packing": trainer.target.packing,
            "drafter_layers": drafter_layers,
            "architecture": architecture,
            "target_layers_run": kept,
            "optimizer_beside_target": trainer.update_stream is not None,  # its span includes the optimizer
        },
        layout=str(topo.layout),
        world_size=topo.world_size,
        drafter_busy=r["drafter_busy"],
        target_busy=r["target_busy"],
        ranks=ranks,
    )


def compile_seconds(top: int = 12) -> dict[str, float]:
    """The largest of dynamo's and inductor's own timers in this process (what
    `torch._dynamo.utils.compile_times` prints), summed per timer: where a cold first step's seconds went.
    The timers nest (a graph's whole compile holds its code generation), so they do not add up."""
    from torch._dynamo.utils import compilation_time_metrics

    sums = {name: sum(times) for name, times in compilation_time_metrics.items()}
    return {k: round(v, 2) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:top]}


def _experts(cfg) -> str | None:
    """The experts implementation of a mixture-of-experts target (transformers' grouped_mm by default)."""
    moe = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    return getattr(cfg, "_experts_implementation", None) if moe else None


def _drafter_bench(
    trainer: Trainer, dev: torch.device, steps: int, warmup: int, profile: Path | None
) -> dict:
    first_timer = PhaseTimer(enabled=True, device=dev)
    t0 = time.perf_counter()
    try:
        trainer.train_step_guarded(first_timer)  # the warm-up: compiles, then recompiles are errors
        sync(dev)
        first_step = time.perf_counter() - t0
        first_phases = first_timer.milliseconds()
        for _ in range(warmup - 1):
            trainer.train_step_guarded()
        sync(dev)
        remote = trainer.remote
        waited = remote.wait_s if remote else 0.0
        t_measure = time.perf_counter()
        times, positions, phases, losses = _measure(trainer, steps, dev)
        wall = time.perf_counter() - t_measure
        if profile is not None:
            _profile(trainer, dev, profile)
    finally:
        torch.compiler.set_stance("default")
    return dict(
        first_step=first_step,
        first_phases=first_phases,
        times=times,
        positions=positions,
        phases=phases,
        losses=losses,
        drafter_busy=1 - trainer.topo.drafter_max(remote.wait_s - waited) / wall if remote else None,
        target_busy=remote.target_busy if remote else None,
    )


PROFILED_STEPS = 2


def _profile(trainer: Trainer, dev: torch.device, out: Path) -> None:
    """PROFILED_STEPS steps under torch.profiler: OUT/trace.json.gz and OUT/ops.txt (module docstring)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out.mkdir(parents=True, exist_ok=True)
    timer = PhaseTimer(enabled=True, device=dev, ranges=True)
    with profiler(activities=activities, record_shapes=True) as prof:
        for _ in range(PROFILED_STEPS):
            trainer.train_step_guarded(timer)
        sync(dev)
    sort = "device_time_total" if dev.type == "cuda" else "cpu_time_total"
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by=sort, row_limit=80, max_name_column_width=60
    )
    (out / "ops.txt").write_text(f"{PROFILED_STEPS} steps, sorted by {sort}\n{table}\n")
    raw = out / "trace.json"
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    (out / "phases.txt").write_text(phase_table(events, PROFILED_STEPS, device=dev.type == "cuda"))
    with raw.open("rb") as src, gzip.open(out / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def phase_table(events: list[dict], steps: int, device: bool, top: int = 15) -> str:
    """DIR/phases.txt from a Chrome trace's events: per phase (the ranges named phase:NAME), its time a step,
    the time its kernels took and its `top` kernels by time a step; on a CPU its outermost operators.

    On the device a kernel belongs to the phase whose range began last before it: a step's phases run
    one after another on one stream, and the device-side range of the backward covers only the kernels
    the main thread launched (autograd launches the rest from its own thread). A phase's time runs from its
    range's start to the end of its range or of its last kernel, whichever is later. On a CPU an operator
    counts in the range it starts in."""
    range_cat, op_cat = ("gpu_user_annotation", "kernel") if device else ("user_annotation", "cpu_op")
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"].removeprefix("phase:"))
        for e in events
        if e.get("cat") == range_cat and e.get("name", "").startswith("phase:")
    )
    ops = sorted((e["ts"], e["dur"], e.get("tid"), e["name"]) for e in events if e.get("cat") == op_cat)
    if not device:  # operators nest on a CPU: keep each thread's outermost
        ends, outer = {}, []
        for op in ops:
            if op[0] >= ends.get(op[2], -1):
                outer.append(op)
                ends[op[2]] = op[0] + op[1]
        ops = outer
    starts, last = [r[0] for r in ranges], [r[1] for r in ranges]
    times: dict[str, dict[str, list]] = {phase: {} for _, _, phase in ranges}
    for ts, dur, _, name in ops:
        k = bisect.bisect_right(starts, ts) - 1
        if k < 0 or (not device and ts >= ranges[k][1]):
            continue
        entry = times[ranges[k][2]].setdefault(name, [0.0, 0])
        entry[0] += dur
        entry[1] += 1
        last[k] = max(last[k], ts + dur)
    spans = dict.fromkeys(times, 0.0)
    for (start, _, phase), end in zip(ranges, last, strict=True):
        spans[phase] += end - start
    unit = "kernels" if device else "operators"
    lines = [f"{steps} steps; a phase's time and its {unit}' times are per step, in ms"]
    for phase, by_name in times.items():
        span, busy = spans[phase] / 1e3 / steps, sum(t for t, _ in by_name.values()) / 1e3 / steps
        lines.append(f"\n{phase}: {span:.2f} ms, {busy:.2f} ms of it in {unit}")
        for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {t / 1e3 / steps:9.2f} {n / steps:6.0f}x  {name[:110]}")
    return "\n".join(lines) + "\n"


def _rank_info(topo, dev, startup: float, first_step: float | None, report=None) -> dict:
    return {
        "rank": topo.rank,
        "role": ("target" if topo.is_target else "drafter") if topo.layout.is_split else "colocated",
        "peak_mem_gib": round(peak_memory_bytes(dev) / 2**30, 2),
        "startup_s": round(startup, 1),
        "first_step_s": None if first_step is None else round(first_step, 1),
        "compile": report.line() if report else None,
    }


def _measure(trainer: Trainer, steps: int, dev: torch.device):
    times, positions, phases, losses = [], [], [], []
    timer = PhaseTimer(enabled=True, device=dev)
    for _ in range(steps):
        timer.reset()
        t0 = time.perf_counter()
        stats = trainer.train_step_guarded(timer)
        sync(dev)
        times.append(time.perf_counter() - t0)
        positions.append(int(stats.draft_positions))
        phases.append(timer.milliseconds())
        losses.append(trainer.step_loss(stats))
    return times, positions, phases, losses
