"""Single-process online training: the frozen target computes features every step, the drafter learns.

Reads top to bottom: build (target, drafter, optimizer, data) -> loop of steps -> checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.config import TrainConfig, save_config
from flashdraft.data.packing import PackedBatch, PackedLoader, load_token_dataset
from flashdraft.model.checkpoint import save_checkpoint
from flashdraft.model.drafter import DFlashDrafter, drafter_config
from flashdraft.model.target import Target, load_target
from flashdraft.train.blocks import default_gamma
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.step import micro_step_loss, plan_micro_batch
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


def resolve_attention(choice: str, device: torch.device) -> str:
    """flex on GPU, the dense SDPA reference on CPU, where flex_attention has no backward."""
    if choice == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if choice == "flex" and device.type == "cpu":
        raise ValueError("attention=flex cannot train on CPU (flex_attention has no CPU backward); use dense")
    return choice


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate: linear warmup, then cosine decay to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class StepStats:
    """What one step measured, kept on the device until a log step reads it."""

    loss_sum: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    draft_positions: torch.Tensor
    weight_sum: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    ctx_tokens: int = 0

    @classmethod
    def zeros(cls, block_size: int, device) -> StepStats:
        z = torch.zeros((), device=device)
        return cls(
            z.clone(), torch.zeros(block_size, device=device), torch.zeros(block_size, device=device), z
        )

    def add(self, out, mb) -> None:
        self.loss_sum += out.weighted_ce.detach()
        self.correct += out.correct
        self.counted += out.counted
        self.draft_positions += (mb.blocks.weights > 0).sum()

    def to_metrics(self) -> dict:
        acc = (self.correct / self.counted.clamp(min=1))[1:]
        return {
            "loss": float(self.loss_sum / self.weight_sum),
            "acc_slot1": float(acc[0]),
            "acc_mean": float(self.correct[1:].sum() / self.counted[1:].sum().clamp(min=1)),
            "acc_per_slot": [round(float(a), 4) for a in acc],
            "grad_norm": float(self.grad_norm),
        }


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    first_loss: float
    checkpoint: Path


def build_drafter(cfg: TrainConfig, model, tokenizer, device) -> DFlashDrafter:
    spec = cfg.drafter
    mask_id = resolve_mask_token_id(
        tokenizer, model.get_input_embeddings().num_embeddings, spec.mask_token_id
    )
    dcfg = drafter_config(
        model.config,
        num_layers=spec.num_layers,
        target_layer_ids=spec.target_layer_ids,
        num_taps=spec.num_taps,
        block_size=spec.block_size,
        mask_token_id=mask_id,
        intermediate_size=spec.intermediate_size,
    )
    drafter = DFlashDrafter(dcfg).to(device=device, dtype=torch.float32)
    init_drafter_(drafter, model.config.initializer_range, seed=cfg.seed)
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


def pick_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def build_trainer(cfg: TrainConfig, target_path: str, data_dir: str, out_dir: str, device: str | None = None):
    """Load the target and the token dataset, build the drafter: a Trainer ready to run."""
    dev = pick_device(device)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_target(target_path, dev)
    drafter = build_drafter(cfg, model, tokenizer, dev)
    pad = cfg.data.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    loader = PackedLoader(
        load_token_dataset(data_dir), cfg.data.seq_len, cfg.data.rows_per_batch, pad, cfg.seed
    )
    per_epoch = [len(loader.rows(e)) // cfg.data.rows_per_batch for e in range(cfg.epochs)]
    if sum(per_epoch) < cfg.grad_accum:
        raise ValueError(f"{data_dir}: too little data for one step ({sum(per_epoch)} batches)")
    total_steps = cfg.max_steps or sum(per_epoch) // cfg.grad_accum

    def batches():
        """Endless stream of packed batches over epochs (the step limit ends training)."""
        epoch = 0
        while True:
            yield from loader.epoch(epoch)
            epoch += 1

    return Trainer(cfg, model, drafter, batches(), total_steps, dev, out_dir, {"target": str(target_path)})


class Trainer:
    """Owns the training state (target, drafter, optimizer, schedule, anchor RNG) and runs steps."""

    def __init__(
        self,
        cfg: TrainConfig,
        model,
        drafter: DFlashDrafter,
        batches: Iterator[PackedBatch],
        total_steps: int,
        device: torch.device,
        out_dir: str | Path | None = None,
        meta: dict | None = None,
    ):
        self.cfg = cfg
        self.device = device
        self.drafter = drafter
        self.target = Target(model, drafter.target_layer_ids, truncate=True)
        self.batches = batches
        self.total_steps = total_steps
        self.out = Path(out_dir) if out_dir else None
        self.meta = meta or {}
        self.gamma = cfg.gamma or default_gamma(cfg.drafter.block_size)
        self.compiled = cfg.compile if cfg.compile is not None else device.type == "cuda"
        self.attention = resolve_attention(cfg.attention, device)
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
            fused=device.type == "cuda",
        )
        warmup = round(cfg.optim.warmup_ratio * total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_lr(s, total_steps, warmup, cfg.optim.min_lr_ratio)
        )
        self.anchor_gen = torch.Generator().manual_seed(cfg.seed + 1)

    def _autocast(self):
        enabled = self.device.type == "cuda"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def train_step(self, timer: PhaseTimer = NULL_TIMER) -> StepStats:
        """One optimizer step over `grad_accum` micro-batches; returns device tensors (no host sync)."""
        cfg = self.cfg
        with timer("data"):
            cpu_batches = [next(self.batches) for _ in range(cfg.grad_accum)]
            micro = [
                plan_micro_batch(
                    b.to(self.device),
                    cfg.num_anchors,
                    self.drafter.block_size,
                    self.drafter.mask_token_id,
                    self.gamma,
                    self.anchor_gen,
                )
                for b in cpu_batches
            ]
        weight_sum = sum(mb.blocks.weights.sum() for mb in micro).clamp(min=1e-6)
        stats = StepStats.zeros(self.drafter.block_size, self.device)
        stats.ctx_tokens = sum(b.num_tokens for b in cpu_batches)
        for mb in micro:
            with self._autocast():
                out = micro_step_loss(self.drafter, self.target, mb, self.attention, self.compiled, timer)
            with timer("backward"):
                (out.weighted_ce / weight_sum).backward()
            stats.add(out, mb)
        with timer("optimizer"):
            stats.grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        stats.weight_sum = weight_sum
        return stats

    def run(self, save_every: int | None = None, progress=None) -> TrainResult:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out / "config.yaml", extra=self.meta)
        ckpt_root = self.out / "checkpoints"
        log = MetricsLogger(self.out, total_steps=self.total_steps)
        first = last = float("nan")
        window_tokens = window_positions = 0
        window_start = time.perf_counter()
        for step in range(1, self.total_steps + 1):
            stats = self.train_step()
            window_tokens += stats.ctx_tokens
            window_positions = window_positions + stats.draft_positions
            if step == 1:
                first = float(stats.loss_sum / stats.weight_sum)
            if step % cfg.log_every == 0 or step == self.total_steps:
                m = stats.to_metrics()
                elapsed = max(time.perf_counter() - window_start, 1e-9)
                m.update(
                    step=step,
                    lr=self.scheduler.get_last_lr()[0],
                    ctx_tok_s=window_tokens / elapsed,
                    draft_pos_s=float(window_positions) / elapsed,
                )
                log.log(m)
                last = m["loss"]
                if progress is not None:
                    progress(step, self.total_steps, m["loss"])
                window_tokens = window_positions = 0
                window_start = time.perf_counter()
            if save_every and step % save_every == 0 and step != self.total_steps:
                save_checkpoint(self.drafter, ckpt_root, step)
        ckpt = save_checkpoint(self.drafter, ckpt_root, self.total_steps)
        log.close()
        (self.out / "result.json").write_text(
            json.dumps({"steps": self.total_steps, "first_loss": first, "final_loss": last})
        )
        return TrainResult(self.total_steps, last, first, ckpt)
