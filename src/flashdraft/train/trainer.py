"""Single-process online training: the frozen target computes features every step, the drafter learns.

Reads top to bottom: build (target, drafter, optimizer, data) -> loop of steps -> checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.config import TrainConfig, save_config
from flashdraft.data.packing import PackedLoader, load_token_dataset
from flashdraft.model.checkpoint import save_checkpoint
from flashdraft.model.drafter import DFlashDrafter, drafter_config
from flashdraft.model.target import Target, load_target
from flashdraft.train.blocks import default_gamma
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.step import micro_step_loss, plan_micro_batch


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


class Trainer:
    def __init__(
        self, cfg: TrainConfig, target_path: str, data_dir: str, out_dir: str, device: str | None = None
    ):
        self.cfg = cfg
        self.out = Path(out_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.manual_seed(cfg.seed)
        model, self.tokenizer = load_target(target_path, self.device)
        self.drafter = build_drafter(cfg, model, self.tokenizer, self.device)
        self.target = Target(model, self.drafter.target_layer_ids, truncate=True)
        self.gamma = cfg.gamma or default_gamma(cfg.drafter.block_size)
        self.compiled = cfg.compile if cfg.compile is not None else self.device.type == "cuda"
        self.attention = resolve_attention(cfg.attention, self.device)
        pad = cfg.data.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.loader = PackedLoader(
            load_token_dataset(data_dir), cfg.data.seq_len, cfg.data.rows_per_batch, pad, cfg.seed
        )
        per_epoch = [len(self.loader.rows(e)) // cfg.data.rows_per_batch for e in range(cfg.epochs)]
        if sum(per_epoch) < cfg.grad_accum:
            raise ValueError(f"{data_dir}: too little data for one step ({sum(per_epoch)} batches)")
        self.total_steps = cfg.max_steps or sum(per_epoch) // cfg.grad_accum
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
            fused=self.device.type == "cuda",
        )
        warmup = round(cfg.optim.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_lr(s, self.total_steps, warmup, cfg.optim.min_lr_ratio)
        )
        self.anchor_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.target_path = str(target_path)

    def _micro_batches(self):
        """Endless stream of packed batches over epochs (the step limit ends training)."""
        epoch = 0
        while True:
            yield from self.loader.epoch(epoch)
            epoch += 1

    def _autocast(self):
        enabled = self.device.type == "cuda"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def train_step(self, batches) -> dict:
        cfg = self.cfg
        micro = [
            plan_micro_batch(
                next(batches).to(self.device),
                cfg.num_anchors,
                self.drafter.block_size,
                self.drafter.mask_token_id,
                self.gamma,
                self.anchor_gen,
            )
            for _ in range(cfg.grad_accum)
        ]
        weight_sum = sum(mb.blocks.weights.sum() for mb in micro).clamp(min=1e-6)
        loss_sum = torch.zeros((), device=self.device)
        correct = counted = 0
        for mb in micro:
            with self._autocast():
                out = micro_step_loss(self.drafter, self.target, mb, self.attention, self.compiled)
            (out.weighted_ce / weight_sum).backward()
            loss_sum += out.weighted_ce.detach()
            correct = correct + out.correct
            counted = counted + out.counted
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        acc = (correct / counted.clamp(min=1))[1:]
        return {
            "loss": float(loss_sum / weight_sum),
            "acc_slot1": float(acc[0]),
            "acc_mean": float(correct[1:].sum() / counted[1:].sum().clamp(min=1)),
            "acc_per_slot": [round(float(a), 4) for a in acc],
            "grad_norm": float(grad_norm),
            "ctx_tokens": sum(mb.batch.num_tokens for mb in micro),
            "draft_positions": int(sum((mb.blocks.weights > 0).sum() for mb in micro)),
        }

    def run(self, save_every: int | None = None, progress=None) -> TrainResult:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out / "config.yaml", extra={"target": self.target_path})
        ckpt_root = self.out / "checkpoints"
        batches = self._micro_batches()
        log = MetricsLogger(self.out, total_steps=self.total_steps)
        first = last = float("nan")
        window_tokens = window_positions = 0
        window_start = time.perf_counter()
        for step in range(1, self.total_steps + 1):
            m = self.train_step(batches)
            window_tokens += m["ctx_tokens"]
            window_positions += m["draft_positions"]
            first = m["loss"] if step == 1 else first
            last = m["loss"]
            if progress is not None:
                progress(step, self.total_steps, m["loss"])
            if step % cfg.log_every == 0 or step == self.total_steps:
                elapsed = max(time.perf_counter() - window_start, 1e-9)
                m.update(
                    step=step,
                    lr=self.scheduler.get_last_lr()[0],
                    ctx_tok_s=window_tokens / elapsed,
                    draft_pos_s=window_positions / elapsed,
                )
                log.log(m)
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
