"""One metrics interface: a human line in train.log, a JSON line in metrics.jsonl, TensorBoard events,
and Weights & Biases when asked (offline unless the user set WANDB_MODE; the API key, if any, stays
in the environment where wandb reads it)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.train.loss import SELECTOR_SUMS


def peak_memory_bytes(device: torch.device) -> int:
    """The GPU's peak allocated bytes (since the last reset of its counter); on a CPU, the process's peak
    resident memory (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        tensorboard: bool = True,
        start_step: int = 0,
        wandb_config: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.start = time.time()
        self.start_step = start_step
        self.log_file = open(self.run_dir / "train.log", "a")  # noqa: SIM115 (open for the run)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tb"))
        self.wandb = _start_wandb(self.run_dir, wandb_config) if wandb_config is not None else None

    def line(self, m: dict) -> str:
        step = m["step"]
        elapsed = time.time() - self.start
        done = step - self.start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else 0.0
        return (
            f"step {step}/{self.total_steps} loss {m['loss']:.4f} acc1 {m['acc_slot1']:.3f} "
            f"acc {m['acc_mean']:.3f} tau_train {m['tau_train']:.2f} lr {m['lr']:.2e} "
            f"ctx {m['ctx_tok_s']:.0f} tok/s "
            f"draft {m['draft_pos_s']:.0f} pos/s mfu {100 * m.get('mfu', 0):.1f}% "
            f"mem {m.get('mem_gib', 0):.1f}GiB eta {eta:.0f}s"
            + (f" tau {m['tau']:.2f}" if "tau" in m else "")
            + (
                f" sel_acc {m['selector_acc']:.3f} sel_tau {m['selector_tau_train']:.2f}"
                if "selector_acc" in m
                else ""
            )
        )

    def log(self, m: dict) -> None:
        text = self.line(m)
        self.log_file.write(text + "\n")
        self.log_file.flush()
        self.jsonl.write(json.dumps({"time": time.time(), **m}) + "\n")
        self.jsonl.flush()
        scalars = {k: v for k, v in m.items() if isinstance(v, int | float) and k != "step"}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(f"train/{key}", value, m["step"])
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in scalars.items()}, step=m["step"])
        self.last_line = text

    def close(self) -> None:
        self.log_file.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(run_dir: Path, config: dict):
    try:
        import wandb
    except ImportError:
        raise RuntimeError("--wandb needs the wandb package: pip install 'flashdraft[wandb]'") from None
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "flashdraft"),
        name=run_dir.name,
        id=f"flashdraft-{run_dir.resolve().name}",
        resume="allow",
        dir=str(run_dir),
        config=config,
        mode=os.environ.get("WANDB_MODE", "offline"),
    )


class Window:
    """What the steps since the last log line add up to (kept on the device until then)."""

    def __init__(self, device, wait_s: float = 0.0):
        self.tokens, self.steps, self.wait_s = 0, 0, wait_s
        self.positions = torch.zeros((), device=device)
        self.start = time.perf_counter()

    def add(self, stats) -> None:
        self.tokens += stats.ctx_tokens
        self.positions += stats.draft_positions
        self.steps += 1


@dataclass
class StepStats:
    """What one step measured, kept on the device until a log step reads it."""

    loss_sum: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    draft_positions: torch.Tensor
    accepted: torch.Tensor
    blocks: torch.Tensor
    weight_sum: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    ctx_tokens: int | torch.Tensor = 0  # a device tensor when the batch arrived from a target rank
    selector: torch.Tensor | None = None  # DFlash2: BlockLoss.selector's sums
    selector_alpha: float | None = None

    @classmethod
    def zeros(cls, block_size: int, device) -> StepStats:
        z = torch.zeros((), device=device)
        slots = torch.zeros(block_size, device=device)
        return cls(z.clone(), slots, slots.clone(), z.clone(), z.clone(), z.clone())

    def add(self, out, mb) -> None:
        self.loss_sum += out.weighted_ce.detach()
        self.correct += out.correct
        self.counted += out.counted
        self.accepted += out.accepted
        self.blocks += out.blocks
        self.draft_positions += (mb.blocks.weights > 0).sum()
        if out.selector is not None:
            self.selector = out.selector if self.selector is None else self.selector + out.selector
            self.selector_alpha = out.selector_alpha

    def to_metrics(self) -> dict:
        acc = (self.correct / self.counted.clamp(min=1))[1:]
        return (
            {
                "loss": float(self.loss_sum / self.weight_sum),
                "acc_slot1": float(acc[0]),
                "acc_mean": float(self.correct[1:].sum() / self.counted[1:].sum().clamp(min=1)),
                "acc_per_slot": [round(float(a), 4) for a in acc],
                "tau_train": float(self.accepted / self.blocks.clamp(min=1)),
            }
            | ({"grad_norm": float(self.grad_norm)} if self.grad_norm is not None else {})
            | self.selector_metrics()
        )

    def selector_metrics(self) -> dict:
        """DFlash2: `loss` is base_loss + selector_alpha x the selector's term (normalised by the step's
        weight sum, as the base loss is); selector_loss is that term's mean over the positions it counts;
        candidate_recall, the label positions whose label is among the top-k; selector_acc, those where
        the selector picks the label given the true previous token (acc_mean is the argmax's);
        selector_tau_train, its tau_train."""
        if self.selector is None:
            return {}
        s = dict(zip(SELECTOR_SUMS, self.selector.tolist(), strict=True))
        positions = max(float(self.counted[1:].sum()), 1.0)
        return {
            "base_loss": s["base_ce"] / float(self.weight_sum),
            "selector_loss": s["selector_ce"] / max(s["selector_weight"], 1e-9),
            "selector_alpha": self.selector_alpha,
            "candidate_recall": s["recalled"] / positions,
            "selector_acc": s["selector_correct"] / positions,
            "selector_tau_train": s["selector_accepted"] / max(float(self.blocks), 1.0),
        }
