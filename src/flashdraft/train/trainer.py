"""Online training: the frozen target computes features every step, the drafter learns.

Reads top to bottom: `build(config)` (topology, target, data, drafter) -> `Trainer` (optimizer,
schedule, and its parts) -> `train_step` -> `run` (the loop: steps, probes, log lines, checkpoints).
The parts, one job each: `features` (train/features.py: this rank's target, or a target rank's
messages), `spec` (train/step.py: how a micro-batch is made and computed, resolved once),
`checkpoints` (train/state.py: resume, save, prune, mirror), the probes (train/probes.py: validation
and tau), the metrics (train/metrics.py). The same loop runs on one CPU, one GPU or many ranks: the
Topology says which micro-batches this rank trains on and owns every collective.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from flashdraft.config import RunConfig, TrainConfig, run_config, save_config
from flashdraft.data.packing import MicroBatchStream, PackedLoader, load_token_dataset
from flashdraft.distributed.exchange import MessageShape, RemoteFeatures, serve_features
from flashdraft.distributed.parallel import (
    clip_divisor,
    gradient_sync,
    parallelize,
    sharding_line,
)
from flashdraft.distributed.topology import Topology, init_topology
from flashdraft.model.checkpoint import latest_checkpoint, load_drafter
from flashdraft.model.drafter import DFlashDrafter, default_target_layer_ids, drafter_config
from flashdraft.model.target import (
    Target,
    choose_packing,
    decoder_layers,
    load_target,
    target_config,
    target_record,
)
from flashdraft.run.fingerprint import ENV_FILE
from flashdraft.run.provenance import check_data_fits_target, check_resume_record, run_record
from flashdraft.train.blocks import default_gamma
from flashdraft.train.compile import (
    recompiles_are_errors,
    reset_stance,
    start_compile_workers,
    use_cache_dir,
    warm_up,
)
from flashdraft.train.features import LocalFeatures, ReceivedFeatures
from flashdraft.train.flops import matmul_tflops, mfu, micro_batch_flops
from flashdraft.train.metrics import MetricsLogger, StepStats, Window
from flashdraft.train.probes import measure_tau, validate
from flashdraft.train.state import Checkpointer, NonFiniteError, write_fingerprint
from flashdraft.train.step import Kernels, StepSpec, micro_step_loss, target_features
from flashdraft.train.timing import NULL_TIMER, PhaseTimer


def resolve_mask_token_id(tokenizer, embedding_rows: int, requested: int | None) -> int:
    """The MASK id must be an existing embedding row. Default: the tokenizer's mask token if it has
    one, else the first embedding row past the tokenizer's vocabulary (151669 for Qwen3)."""
    if requested is not None:
        mask_id = requested
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        mask_id = tokenizer.mask_token_id
    elif len(tokenizer) < embedding_rows:
        mask_id = len(tokenizer)
    else:
        raise ValueError(
            "the target's embedding has no row beyond its tokenizer and the tokenizer has no mask token: "
            "set drafter.mask_token_id to a rarely used token id"
        )
    if not 0 <= mask_id < embedding_rows:
        raise ValueError(f"mask_token_id {mask_id} is not a row of the {embedding_rows}-row embedding")
    return int(mask_id)


def resolve_attention(choice: str, device: torch.device, head_dim: int) -> str:
    """flex on GPU, the dense SDPA reference on CPU, where flex_attention has no backward."""
    if choice == "auto":
        choice = "flex" if device.type == "cuda" else "dense"
    if choice == "flex" and device.type == "cpu":
        raise ValueError("attention=flex cannot train on CPU (flex_attention has no CPU backward); use dense")
    if choice == "flex" and head_dim < 16:  # inductor's flex kernels: "embedding dimension ... at least 16"
        raise ValueError(
            f"flex_attention needs a head size of at least 16, the drafter's is {head_dim}: "
            "set drafter.head_dim (or attention: dense)"
        )
    return choice


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate: linear warmup, then cosine decay to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Interrupted(RuntimeError):
    """Ctrl-C: the run stopped after a whole step, saved; the message names the checkpoint."""


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    first_loss: float
    checkpoint: Path


def tap_ids(cfg: TrainConfig, target_config) -> list[int]:
    """The target layers the run's drafter reads (set, from init_from, or spread over the target)."""
    if cfg.drafter.target_layer_ids:
        return list(cfg.drafter.target_layer_ids)
    return default_target_layer_ids(target_config.get_text_config().num_hidden_layers, cfg.drafter.num_taps)


def layers_to_load(cfg: TrainConfig, topo: Topology, taps: list[int]) -> int | None:
    """How many of the target's decoder layers this rank runs (`load_target(layers=...)`): none on a
    drafter rank of a split layout (the embedding and lm_head are all it uses), every one for
    distillation (the final hidden state) and for tau during training (decoding), else up to the last
    tap."""
    if not topo.is_target:
        return 0
    if cfg.distill or cfg.eval_every:
        return None
    return max(taps) + 1


def drafter_and_target(
    cfg: TrainConfig, model, tokenizer, topo: Topology, target_config=None
) -> tuple[DFlashDrafter, Target]:
    """The run's drafter (initialised from the seed, or the init_from drafter) and the Target it reads,
    packed as the target needs (`choose_packing`, measured on a target rank and shared with the drafter
    ranks of a split layout): what `build` gives the Trainer. `tokenizer` may be None when
    drafter.mask_token_id is set; `target_config` is the whole target's when `model` holds only its
    first layers."""
    whole = target_config or model.config
    if cfg.init_from:
        drafter = load_drafter(cfg.init_from, topo.device)
    else:
        drafter = build_drafter(cfg, model, tokenizer, topo.device, whole)
    asked = cfg.data.one_document_per_row
    ids = drafter.target_layer_ids
    packing = "one_document" if asked else choose_packing(model, ids) if topo.is_target else None
    if topo.distributed:  # the drafter ranks of a split layout hold no layers to probe
        packing = next(p for p in topo.gather_objects(packing) if p is not None)
    if packing == "one_document" and not asked and topo.is_main:
        print(
            "the target's layers carry state across packed documents (no mask keeps them apart): "
            "training rows hold one document each",
            flush=True,
        )
    return drafter, Target(model, ids, packing, config=whole)


def with_init_from(cfg: TrainConfig, target_config) -> TrainConfig:
    """`cfg` with the drafter shape of its init_from directory (a z-lab drafter, validated as an export
    is), checked against the target; a drafter setting given in the config that differs is an error."""
    from flashdraft.export.formats import block_size_of, read_zlab

    source = Path(cfg.init_from)
    raw, _ = read_zlab(source)
    t = target_config.get_text_config()
    ids = list(raw["dflash_config"]["target_layer_ids"])
    fits = {
        "hidden_size": (raw["hidden_size"], t.hidden_size),
        "vocab_size": (raw["vocab_size"], t.vocab_size),
        "num_target_layers": (raw["num_target_layers"], t.num_hidden_layers),
    }
    problems = [
        f"{k} {ours} (the target's: {theirs})" for k, (ours, theirs) in fits.items() if ours != theirs
    ]
    if problems:
        raise ValueError(f"init_from {source}: a drafter for another target: " + "; ".join(problems))
    shape = {
        "num_layers": raw["num_hidden_layers"],
        "target_layer_ids": ids,
        "num_taps": len(ids),
        "block_size": block_size_of(raw),
        "mask_token_id": raw["dflash_config"]["mask_token_id"],
        "intermediate_size": raw["intermediate_size"],
        "num_attention_heads": raw["num_attention_heads"],
        "num_key_value_heads": raw["num_key_value_heads"],
        "head_dim": raw["head_dim"],
        "layer_types": list(raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]),
        "sliding_window": raw.get("sliding_window") if raw.get("use_sliding_window") else None,
    }
    given = cfg.drafter.model_fields_set
    conflicts = [
        f"drafter.{k}: {getattr(cfg.drafter, k)} here, {v} in {source}"
        for k, v in shape.items()
        if k in given and getattr(cfg.drafter, k) != v
    ]
    if conflicts:
        raise ValueError(
            f"init_from {source} fixes the drafter's shape; leave these unset or match them: "
            + "; ".join(conflicts)
        )
    return cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update=shape)})


def compiles(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether a run compiles: `cfg.compile`, by default on a GPU."""
    return cfg.compile if cfg.compile is not None else device.type == "cuda"


def build_drafter(cfg: TrainConfig, model, tokenizer, device, target_config=None) -> DFlashDrafter:
    """A drafter for `model` (`target_config`: the whole target's, when the model holds only its first
    layers), initialised from the seed."""
    spec = cfg.drafter
    mask_id = resolve_mask_token_id(
        tokenizer, model.get_input_embeddings().num_embeddings, spec.mask_token_id
    )
    dcfg = drafter_config(
        target_config or model.config,
        num_layers=spec.num_layers,
        target_layer_ids=spec.target_layer_ids,
        num_taps=spec.num_taps,
        block_size=spec.block_size,
        mask_token_id=mask_id,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        rope_theta=spec.rope_theta,
        layer_types=spec.layer_types,
        sliding_window=spec.sliding_window,
    )
    drafter = DFlashDrafter(dcfg).to(device=device, dtype=torch.float32)
    std = getattr(model.config.get_text_config(), "initializer_range", None) or 0.02
    init_drafter_(drafter, std, seed=cfg.seed)
    return drafter


def init_drafter_(drafter: DFlashDrafter, std: float, seed: int) -> None:
    """Explicit init: normal(0, std) linears, ones for norms; seeded so runs are reproducible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def build_trainer(
    cfg: TrainConfig,
    target_path: str,
    data_dir: str,
    out_dir: str,
    device: str | None = None,
    layout: str = "colocated",
    resume: bool = False,
    s3_url: str | None = None,
    backend: str = "auto",
    overwrite: bool = False,
) -> Trainer:
    """`build` of a recipe and its run settings given one by one."""
    run = {"target": target_path, "data": data_dir, "out": out_dir, "device": device, "layout": layout}
    run |= {"resume": resume, "s3": s3_url, "backend": backend, "overwrite": overwrite}
    return build(run_config(cfg, **run))


@dataclass(frozen=True)
class Batches:
    """A run's training batches (a MicroBatchStream's interface), its held-out ones, and what the
    run records of its target and data (checked on resume)."""

    stream: Any
    val: PackedLoader | None
    record: dict


@dataclass(frozen=True)
class RunSource:
    """What a run reads. `build` makes it from `run.target` and `run.data` (`path_source`);
    `flashdraft bench` gives random weights of a named shape and synthetic batches.

    target_config: the whole target's. load_target(layers, device, attention): (model, tokenizer)
    holding the first `layers` decoder layers (None: all). batches(cfg, model, tokenizer, packing): the
    Batches. target_record(model): what a checkpoint records of the target. load_sharded(layers, topo,
    attention): as load_target, the layers sharded over the rank's target group (None: not offered)."""

    target_config: Any
    load_target: Callable[[int | None, torch.device, str], tuple]
    batches: Callable[[TrainConfig, Any, Any, str], Batches]
    target_record: Callable[[Any], dict]
    load_sharded: Callable[[int | None, Topology, str], tuple] | None = None


def path_source(target_path: str, data_dir: str) -> RunSource:
    """The target from a directory, hub id or .gguf file; the token dataset from `data prepare`."""

    def load(layers, device, attention):
        return load_target(target_path, device, attention=attention, layers=layers)

    def load_sharded(layers, topo, attention):
        from flashdraft.distributed.sharded_target import load_sharded_target

        return load_sharded_target(target_path, topo, attention=attention, layers=layers)

    def batches(cfg: TrainConfig, model, tokenizer, packing: str) -> Batches:
        pad = cfg.data.pad_token_id
        if pad is None:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        rows = (cfg.data.seq_len, cfg.data.rows_per_batch, pad, cfg.seed, packing == "one_document")
        dataset = load_token_dataset(data_dir)
        check_data_fits_target(data_dir, dataset, tokenizer, model.get_input_embeddings().num_embeddings)
        val = None
        if cfg.val_data:  # the config refuses it in a split layout
            val = PackedLoader(load_token_dataset(cfg.val_data), *rows)
            if val.batches_in_epoch(0) == 0:
                raise ValueError(
                    f"val_data {cfg.val_data}: too little for one micro-batch of "
                    f"{cfg.data.rows_per_batch} x {cfg.data.seq_len} tokens"
                )
        stream = MicroBatchStream(PackedLoader(dataset, *rows), cfg.epochs)
        return Batches(stream, val, run_record(target_path, model, data_dir, dataset))

    return RunSource(
        target_config(target_path),
        load,
        batches,
        lambda model: target_record(target_path, model),
        load_sharded,
    )


def check_sharded_fits(cfg: TrainConfig, topo: Topology) -> None:
    """The ranks of a target group run one forward together per micro-batch, so in a split layout each
    target rank must serve as many micro-batches a step as the others."""
    lay = topo.layout
    if lay.is_split and cfg.grad_accum * lay.drafters % lay.targets:
        raise ValueError(
            f"target parallelism {topo.target_parallel} in layout {lay}: a step's "
            f"{cfg.grad_accum * lay.drafters} micro-batches (grad_accum x {lay.drafters} drafter ranks) do "
            f"not divide evenly over the {lay.targets} target ranks, whose groups must run the same number "
            "of forwards"
        )


def build(config: RunConfig, source: RunSource | None = None) -> Trainer:
    """Read the world, load the target and the token dataset, build the drafter: a Trainer ready to run.

    With `run.s3`, checkpoints and logs are mirrored there; resuming with an empty `run.out` first
    restores the run's newest complete checkpoint from it (a fresh machine). A `run.out` holding a run
    is refused unless `run.resume` (continue it) or `run.overwrite` (delete it and start again); a resume
    checks the target and data against the run's record (flashdraft.run.provenance). `source`: what the
    run reads, by default `path_source(run.target, run.data)`.
    """
    cfg, run = config, config.run
    out_dir, resume, s3_url = run.out, run.resume, run.s3
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb needs the wandb package: pip install 'flashdraft[wandb]'")
    topo = init_topology(run.parsed_layout, run.device, run.backend, run.target_parallel)
    if compiles(cfg, topo.device):
        start_compile_workers()  # they start while the target loads
    out = Path(out_dir)
    existing = [n for n in ("config.yaml", "checkpoints") if (out / n).exists()]
    if existing and not resume:
        if not run.overwrite:
            raise ValueError(
                f"{out} holds a run ({', '.join(existing)}): --resume {out} continues it, --overwrite "
                "deletes it and starts again, or choose another --out"
            )
        if topo.is_main:
            shutil.rmtree(out)
        topo.barrier()
    if resume and s3_url and topo.is_main and latest_checkpoint(Path(out_dir) / "checkpoints") is None:
        from flashdraft.run.s3 import restore_run

        restore_run(s3_url, Path(out_dir))
    topo.barrier()
    torch.manual_seed(cfg.seed)
    source = source or path_source(run.target, run.data)
    whole = source.target_config
    if cfg.init_from:  # checked against the target's config before the target loads
        cfg = with_init_from(cfg, whole)
    layers = layers_to_load(cfg, topo, tap_ids(cfg, whole))
    if topo.target_group is not None:
        check_sharded_fits(cfg, topo)
        if source.load_sharded is None:
            raise ValueError("this run's target cannot be sharded (it is not read from a directory)")
        model, tokenizer = source.load_sharded(layers, topo, cfg.target_attention)
        if topo.rank == 0:
            from flashdraft.distributed.sharded_target import sharding_line

            print(sharding_line(model, topo), flush=True)
    else:
        model, tokenizer = source.load_target(layers, topo.device, cfg.target_attention)
        if cfg.target_fp8:
            from flashdraft.model.fp8 import check_fp8_device

            check_fp8_device(topo.device)
    drafter, target = drafter_and_target(cfg, model, tokenizer, topo, whole)
    if cfg.target_fp8:  # after the packing probe, which differentiates through the target
        from flashdraft.model.fp8 import to_fp8_

        replaced, kept = to_fp8_(decoder_layers(model)[2])
        if topo.rank == 0:
            print(f"target in FP8: {replaced} linears e4m3 (row-wise scales), {kept} kept", flush=True)
    drafter.config.flashdraft_target = source.target_record(model)  # written with every checkpoint
    batches = source.batches(cfg, model, tokenizer, target.packing)
    del model  # the Target holds it
    record, stream = batches.record, batches.stream
    if resume and (out / "config.yaml").is_file():
        saved = yaml.safe_load((out / "config.yaml").read_text()) or {}
        check_resume_record(saved.get("record") or saved, record, out)  # top level: older runs
    per_step = cfg.grad_accum * topo.num_drafters
    held = stream.upto(per_step)  # the whole length only when max_steps does not set it
    if held < per_step:
        raise ValueError(f"{run.data}: too little data for one step ({held} batches, {per_step} needed)")
    total_steps = cfg.max_steps or len(stream) // per_step
    val = batches.val
    meta = record
    trainer = Trainer(cfg, target, drafter, stream, total_steps, topo, out_dir, meta, resume)
    trainer.val_loader = val
    if s3_url and topo.is_main:
        from flashdraft.run.s3 import S3Mirror

        trainer.mirror = S3Mirror(s3_url)
    if cfg.eval_every and topo.is_main:
        from flashdraft.eval.spec import read_prompts

        trainer.tau_probe = (tokenizer, read_prompts(cfg.eval_prompts, limit=cfg.eval_num_prompts))
    return trainer


class Trainer:
    """Owns the training state (target, drafter, optimizer, schedule, step) and runs steps."""

    def __init__(
        self,
        cfg: TrainConfig,
        target: Target,
        drafter: DFlashDrafter,
        stream,
        total_steps: int,
        topo: Topology | None = None,
        out_dir: str | Path | None = None,
        meta: dict | None = None,
        resume: bool = False,
    ):
        """target: taps the drafter's layers; its packing is how the rows of `stream` hold documents
        (`flashdraft.model.target.choose_packing`). A drafter rank of a split layout holds the target's
        embedding and lm_head alone (`load_target(layers=0)`)."""
        target.require_taps(drafter.target_layer_ids)
        self.cfg = cfg
        self.topo = topo or Topology(device=next(drafter.parameters()).device)
        self.device = self.topo.device
        self.drafter = drafter
        self.feature_dim = len(drafter.target_layer_ids) * target.config.hidden_size
        self.feature_dtype = target.embed_tokens.weight.dtype
        self.target = target
        if self.topo.is_main:
            print(self.target.describe(), flush=True)
            print(drafter.describe(), flush=True)
        self.stream = stream
        self.total_steps = total_steps
        self.out = Path(out_dir) if out_dir else None
        self.meta = meta or {}
        self.compiled = compiles(cfg, self.device)
        self.attention = resolve_attention(cfg.attention, self.device, drafter.config.head_dim)
        self.spec = StepSpec(
            Kernels(
                self.attention,
                self.compiled,
                cfg.recompute_logits,
                cfg.distill,
                cfg.dpace_alpha if cfg.position_weights == "dpace" else None,
            ),
            cfg.num_anchors,
            drafter.block_size,
            drafter.mask_token_id,
            cfg.gamma or default_gamma(cfg.drafter.block_size),
            cfg.anchors_per_document,
            cfg.seed,
            cfg.grad_accum,
            self.topo.num_drafters,
        )
        self.compile_report = None
        if cfg.compile_target and not self.compiled:
            raise ValueError("compile_target needs compile (on by default on GPU; set compile: true)")
        self.compile_target = self.compiled if cfg.compile_target is None else cfg.compile_target
        self.cache_dir = use_cache_dir(None, self.device) if self.compiled else None
        if self.compiled:
            for layer in drafter.layers:
                layer.compile(dynamic=False)
            if self.compile_target and self.topo.is_target:
                # forward only: the tap hooks stay eager; decoding (tau) runs eagerly anyway
                for layer in decoder_layers(self.target.model)[2]:
                    layer.forward = torch.compile(layer.forward, dynamic=False)
        self.model = parallelize(drafter, self.topo, cfg.fsdp)
        if cfg.fsdp and self.topo.is_main:
            print(sharding_line(drafter), flush=True)
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
            fused=True,  # on the device: skips a step when found_inf is set, clips by grad_scale
        )
        warmup = round(cfg.optim.warmup_ratio * total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_lr(s, total_steps, warmup, cfg.optim.min_lr_ratio)
        )
        self.flops_per_micro = micro_batch_flops(cfg, target.whole_config, drafter.config)
        self.peak_tflops: float | None = None  # measured at the start of run() on the main rank
        self.peak_fp8_tflops: float | None = None  # and the FP8 rate, with target_fp8
        self.step = 0
        self.bad_run = torch.zeros((), dtype=torch.long, device=self.device)  # consecutive skipped steps
        self.skipped = torch.zeros((), dtype=torch.long, device=self.device)
        self.tau_probe = None  # (tokenizer, prompts) on the main rank when eval_every is set
        self.pending: dict = {}  # measured at a step, logged with that step's (or the next) line
        self.val_loader: PackedLoader | None = None  # held-out conversations (cfg.val_data)
        self.last_metrics: dict = {}
        self.checkpoints = Checkpointer(cfg, self.topo, self.out, self.compiled, self.cache_dir)
        self.remote = None  # a drafter rank of a split layout: the features it receives
        if self.topo.layout.is_split and self.topo.is_drafter:
            self.remote = RemoteFeatures(self.topo, self.message_shape(), cfg.grad_accum)
        self.features = ReceivedFeatures(self.remote) if self.remote else LocalFeatures(self)
        if resume:
            self.checkpoints.resume(self)

    @property
    def mirror(self):
        """The S3 mirror of the run's checkpoints and files, if it has one (Checkpointer.mirror)."""
        return self.checkpoints.mirror

    @mirror.setter
    def mirror(self, mirror) -> None:
        self.checkpoints.mirror = mirror

    def save(self) -> Path | None:
        """A checkpoint of this step (Checkpointer.save): the main rank's path, None on the others."""
        return self.checkpoints.save(self)

    def message_shape(self) -> MessageShape:
        return MessageShape(
            self.cfg.data.rows_per_batch, self.cfg.data.seq_len, self.feature_dim, self.feature_dtype
        )

    def micro_indices(self, step: int) -> list[int]:
        """Global micro-batches this drafter rank trains on at `step` (1-based)."""
        base = (step - 1) * self.spec.micro_per_step
        return [
            base + g * self.topo.num_drafters + self.topo.drafter_rank for g in range(self.cfg.grad_accum)
        ]

    def _autocast(self):
        enabled = self.device.type == "cuda"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _micro_batch(self, m: int, next_m: int | None, timer: PhaseTimer):
        batch, feats, teacher, ctx_tokens = self.features.get(m, next_m, timer)
        return self.spec.plan(batch, m, feats, teacher), ctx_tokens

    def train_step(self, timer: PhaseTimer = NULL_TIMER) -> StepStats:
        """One optimizer step over this rank's micro-batches; returns device tensors (no host sync)."""
        cfg = self.cfg
        step = self.step + 1
        indices = self.micro_indices(step)
        following = self.micro_indices(step + 1)[0] if step < self.total_steps else None
        planned = [
            self._micro_batch(m, indices[i + 1] if i + 1 < len(indices) else following, timer)
            for i, m in enumerate(indices)
        ]
        micro = [mb for mb, _ in planned]
        # the loss is normalised by the weight sum of the whole global step, over every rank
        weight_sum = self.topo.drafter_sum_(sum(mb.blocks.weights.sum() for mb in micro)).clamp(min=1e-6)
        scale = self.topo.num_drafters  # DDP and FSDP2 average gradients over drafter ranks
        stats = StepStats.zeros(self.drafter.block_size, self.device)
        stats.ctx_tokens = sum(n for _, n in planned)
        for i, mb in enumerate(micro):
            with gradient_sync(self.model, enabled=i == len(micro) - 1):
                with self._autocast():
                    out = micro_step_loss(self.model, self.target, mb, self.spec.kernels, timer)
                with timer("backward"):
                    (out.weighted_ce * scale / weight_sum).backward()
            stats.add(out, mb)
        with timer("optimizer"):
            # clipped inside fused AdamW's own kernel: it divides the gradients by its grad_scale
            stats.grad_norm, self.optimizer.grad_scale = clip_divisor(
                self.drafter.parameters(), cfg.optim.grad_clip
            )
            # a non-finite loss or gradient skips the update on the device, with no host sync;
            # the host reads the count at log and save steps
            bad = ~torch.isfinite(stats.grad_norm)
            self.optimizer.found_inf = bad.float()
            self.bad_run = (self.bad_run + 1) * bad
            self.skipped += bad
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        stats.weight_sum = weight_sum
        self.step = step
        return stats

    def train_step_guarded(self, timer: PhaseTimer = NULL_TIMER) -> StepStats:
        """train_step; the first compiled one is the warm-up, after which recompiling is an error."""
        if not self.compiled:
            return self.train_step(timer)
        if self.compile_report is None:
            out: list[StepStats] = []
            self.compile_report = warm_up(
                lambda: out.append(self.train_step(timer)), self.cache_dir, self.checkpoints.artifacts_loaded
            )
            print(f"[rank {self.topo.rank}] {self.compile_report.line()}", flush=True)
            return out[0]
        with recompiles_are_errors():
            return self.train_step(timer)

    def _reduce_stats(self, stats: StepStats) -> None:
        """Sum a step's loss and accuracy counts over drafter ranks (at log steps only)."""
        for t in (stats.loss_sum, stats.correct, stats.counted, stats.accepted, stats.blocks):
            self.topo.drafter_sum_(t)

    def serve(self, until: int) -> None:
        """Target rank of a split layout: compute and send features for every step up to `until`."""
        per_step = self.spec.micro_per_step
        start = self.step * per_step
        feats = lambda batch, plain: target_features(self.target, batch, plain)  # noqa: E731
        serve_features(self.topo, feats, self.stream, until * per_step, self.message_shape(), start)

    def run(
        self, progress=None, until: int | None = None, deadline: float | None = None
    ) -> TrainResult | None:
        """Train to `total_steps`; checkpoints every `save_every` steps and at the end (main rank).

        until: stop after this step instead, with a checkpoint that `--resume` continues from (a slice of
        the run, for allocations shorter than the run); the schedule stays that of `total_steps`.
        deadline: a `time.time()` after which the run stops the same way, after the step (and its probe)
        in progress: a slice that ends on the clock rather than on a step count estimated from a timed step,
        which ran 7% slow over a 9-minute slice on the H200 (session 26) and was killed before it saved.
        One process only: ranks would pass the deadline at different steps."""
        self.check_slice(until, deadline)
        until = until or self.total_steps  # a run resumed at its end saves and reports again
        if not self.topo.is_drafter:
            self.serve(until)
            return None
        if self.device.type == "cuda":  # mem_gib is this run's peak, not that of what the process did first
            torch.cuda.reset_peak_memory_stats()
        try:
            return self._run(progress, until, deadline)
        finally:
            if self.compiled:
                reset_stance()

    def check_slice(self, until: int | None, deadline: float | None) -> None:
        """ValueError unless `run(until=..., deadline=...)` can run that slice of this run."""
        if until is not None and not self.step < until <= self.total_steps:
            raise ValueError(f"until={until}: must lie after step {self.step} and by {self.total_steps}")
        if deadline is not None and self.topo.world_size > 1:
            raise ValueError(
                f"a run of {self.topo.world_size} processes cannot stop on the clock (its ranks would stop "
                "at different steps): give it a step to stop at instead"
            )

    def _run(self, progress, until: int, deadline: float | None) -> TrainResult:
        cfg = self.cfg
        main = self.topo.is_main
        log = None
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.checkpoints.start()
            save_config(cfg, self.out / "config.yaml", record={**self.meta, "layout": str(self.topo.layout)})
            write_fingerprint(self.out / ENV_FILE, self.fingerprint_extra())
            wandb_config = cfg.model_dump(mode="json") if cfg.wandb else None
            log = MetricsLogger(self.out, self.total_steps, start_step=self.step, wandb_config=wandb_config)
            self.peak_tflops = matmul_tflops(self.device)
            self.peak_fp8_tflops = matmul_tflops(self.device, fp8=True) if cfg.target_fp8 else None
        first = last = float("nan")
        window = Window(self.device)
        with self._stop_on_interrupt() as interrupted:
            while self.step < until:
                stats = self.train_step_guarded()
                step = self.step
                window.add(stats)
                late = deadline is not None and time.time() >= deadline and step < until
                if step == 1:
                    first = float(self.topo.drafter_sum_(stats.loss_sum.clone()) / stats.weight_sum)
                if self.tau_probe is not None and (step % cfg.eval_every == 0 or step == self.total_steps):
                    self.pending |= self.measure_tau()
                if self.val_loader is not None and (
                    (cfg.val_every and step % cfg.val_every == 0) or step == self.total_steps
                ):
                    self.pending |= self.validate()
                if step % cfg.log_every == 0 or step in (until, self.total_steps) or late:
                    m = self._metrics(stats, window)
                    last = m["loss"]
                    if main:
                        log.log(m)
                        if progress is not None:
                            progress(step, self.total_steps, m["loss"])
                    window = Window(self.device, self.remote.wait_s if self.remote else 0.0)
                saving = cfg.save_every and step % cfg.save_every == 0 and step != self.total_steps
                if saving or step % cfg.log_every == 0 or interrupted():
                    self._check_finite()
                if interrupted() and step != self.total_steps:
                    path = self.save()
                    if main:
                        log.close()
                    raise Interrupted(
                        f"interrupted after step {step}: saved {path}; --resume {self.out} continues"
                    )
                if late:  # saved below
                    break
                if saving:
                    self.save()
        ckpt = self.save()
        if self.step < self.total_steps:
            if main:
                log.close()
            return TrainResult(self.step, last, first, ckpt)
        if main:
            log.close()
            finite = {
                k: v if math.isfinite(v) else None for k, v in (("first_loss", first), ("final_loss", last))
            }
            (self.out / "result.json").write_text(json.dumps({"steps": self.total_steps, **finite}))
            self.checkpoints.finish()
        return TrainResult(self.total_steps, last, first, ckpt)

    @contextlib.contextmanager
    def _stop_on_interrupt(self):
        """In a one-process run, Ctrl-C asks the loop to stop after the step it is in, save, and raise
        Interrupted; a second Ctrl-C interrupts at once. A run of several ranks keeps the default (its
        ranks would not stop at the same step): its last checkpoint is what it resumes from."""
        asked = []
        in_main = threading.current_thread() is threading.main_thread()
        # a process started with SIGINT ignored (a shell's background job) keeps ignoring it
        if self.topo.world_size > 1 or not in_main or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            yield lambda: False
            return

        def handler(signum, frame):
            asked.append(signum)
            signal.signal(signal.SIGINT, previous)
            print(
                "\ninterrupted: stopping after this step, then saving (Ctrl-C again stops at once)",
                flush=True,
            )

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield lambda: bool(asked)
        finally:
            signal.signal(signal.SIGINT, previous)

    def _metrics(self, stats: StepStats, window: Window) -> dict:
        """The log line's numbers: the step's loss and accuracy, the window's rates (all ranks)."""
        self._reduce_stats(stats)
        totals = torch.stack([window.positions, window.positions.new_tensor(float(window.tokens))])
        positions, tokens = self.topo.drafter_sum_(totals).tolist()
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        micro = self.spec.micro_per_step * window.steps
        done = {k: v * micro for k, v in self.flops_per_micro.items()}
        m = stats.to_metrics()
        m.update(
            step=self.step,
            lr=self.scheduler.get_last_lr()[0],
            ctx_tok_s=tokens / elapsed,
            draft_pos_s=positions / elapsed,
            mfu=mfu(done, elapsed, self.peak_tflops, self.peak_fp8_tflops, self.topo.world_size)
            if self.peak_tflops  # the main rank's
            else 0.0,
            mem_gib=torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else 0.0,
            skipped_steps=int(self.skipped),
        )
        if self.remote is not None:
            m["drafter_busy"] = 1 - self.topo.drafter_max(self.remote.wait_s - window.wait_s) / elapsed
            m["target_busy"] = self.remote.target_busy
        m.update(self.pending)
        self.pending = {}
        self.last_metrics = m
        return m

    def close(self) -> None:
        """Release the DDP wrapper before the process group: a gloo group destroyed while DDP's
        reducer still holds it hangs in the reducer's destructor at exit."""
        self.model = self.drafter
        gc.collect()
        self.topo.close()

    def _check_finite(self) -> None:
        """Stop after `max_bad_steps` consecutive non-finite steps, saving the last good state (skipped
        steps change neither weights nor optimizer state, so the current state is the last good one)."""
        run = int(self.topo.drafter_sum_(self.bad_run.clone()))
        if run >= self.cfg.max_bad_steps:
            path = self.save()
            raise NonFiniteError(
                f"{run} consecutive steps up to step {self.step} had a non-finite loss or gradient and "
                f"were skipped; stopped. The last good weights are saved in {path}. Lower optim.lr or "
                "check the data."
            )

    def validate(self) -> dict:
        """The training metrics on held-out conversations (train/probes.py `validate`)."""
        return validate(self)

    def measure_tau(self) -> dict:
        """Greedy tau on held-out prompts against the running target (train/probes.py `measure_tau`)."""
        return measure_tau(self)

    def fingerprint_extra(self) -> dict:
        keys = ("step", "ctx_tok_s", "draft_pos_s", "loss")
        return {"throughput": {k: self.last_metrics[k] for k in keys if k in self.last_metrics}}
