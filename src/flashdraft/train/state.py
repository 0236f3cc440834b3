"""Trainer state saved beside the z-lab weights, so `--resume` continues exactly where a run stopped.

trainer_state.pt holds the step, the fp32 master weights (the z-lab file is bf16), the optimizer
and scheduler states and the config it ran with: plain tensors and containers, loaded with
`torch.load(weights_only=True)`, which executes no pickled code. The data position and the anchor
RNG are pure functions of the step (see MicroBatchStream and row_generators), so nothing else is
needed to continue bit for bit.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from flashdraft.config import TrainConfig
from flashdraft.distributed.parallel import load_full_state

STATE = "trainer_state.pt"
log = logging.getLogger(__name__)

# Fields that change what the step computes or which data it sees: a resume must keep them.
_FIXED = [
    "drafter",
    "data.seq_len",
    "data.rows_per_batch",
    "num_anchors",
    "anchors_per_document",
    "gamma",
    "seed",
    "epochs",
    "attention",
]


def trainer_state_writer(trainer, weights: dict, optimizer: dict):
    """weights, optimizer: the drafter's and optimizer's full state (dist.parallel.full_state)."""

    def write(path: Path) -> None:
        state = {
            "step": trainer.step,
            "micro_per_step": trainer.cfg.grad_accum * trainer.topo.num_drafters,
            "master": {k: v.detach().cpu() for k, v in weights.items()},
            "optimizer": optimizer,
            "scheduler": trainer.scheduler.state_dict(),
            "config": trainer.cfg.model_dump(mode="json"),
        }
        torch.save(state, path)

    return write


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def check_resumable(saved: dict, cfg: TrainConfig, micro_per_step: int, where: Path) -> None:
    now = cfg.model_dump(mode="json")
    changed = [k for k in _FIXED if _get(saved["config"], k) != _get(now, k)]
    if changed:
        details = "; ".join(f"{k}: {_get(saved['config'], k)} -> {_get(now, k)}" for k in changed)
        raise ValueError(f"cannot resume from {where}: the run changed {details}")
    if saved["micro_per_step"] != micro_per_step:
        raise ValueError(
            f"cannot resume from {where}: it ran {saved['micro_per_step']} micro-batches per step "
            f"(grad_accum x drafter ranks), this run has {micro_per_step}; keep the global batch"
        )
    for key in ("optim", "max_steps", "log_every", "save_every", "keep_last", "eval_every", "eval_prompts"):
        if saved["config"].get(key) != now.get(key):
            log.warning("resume: %s changed from %s to %s", key, saved["config"].get(key), now.get(key))


def load_trainer_state(ckpt: Path, trainer) -> int:
    """Restore weights, optimizer and schedule from checkpoint `ckpt`; returns its step."""
    path = Path(ckpt) / STATE
    if not path.exists():
        raise ValueError(f"cannot resume from {ckpt}: no {STATE} (an export, not a training checkpoint?)")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    check_resumable(saved, trainer.cfg, trainer.cfg.grad_accum * trainer.topo.num_drafters, ckpt)
    load_full_state(trainer.drafter, trainer.optimizer, saved["master"], saved["optimizer"])
    for group in trainer.optimizer.param_groups:  # a changed learning rate applies from here on
        group["initial_lr"] = trainer.cfg.optim.lr
    trainer.scheduler.base_lrs = [trainer.cfg.optim.lr for _ in trainer.scheduler.base_lrs]
    trainer.scheduler.load_state_dict({**saved["scheduler"], "base_lrs": trainer.scheduler.base_lrs})
    return int(saved["step"])
