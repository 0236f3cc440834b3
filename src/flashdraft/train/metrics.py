"""One metrics interface: a human line in train.log, a JSON line in metrics.jsonl, TensorBoard events."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.start = time.time()
        self.log_file = open(self.run_dir / "train.log", "a")  # noqa: SIM115 (open for the run)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tb"))

    def line(self, m: dict) -> str:
        step = m["step"]
        elapsed = time.time() - self.start
        eta = elapsed / step * (self.total_steps - step) if step else 0.0
        return (
            f"step {step}/{self.total_steps} loss {m['loss']:.4f} acc1 {m['acc_slot1']:.3f} "
            f"acc {m['acc_mean']:.3f} lr {m['lr']:.2e} ctx {m['ctx_tok_s']:.0f} tok/s "
            f"draft {m['draft_pos_s']:.0f} pos/s mfu {100 * m.get('mfu', 0):.1f}% "
            f"mem {m.get('mem_gib', 0):.1f}GiB eta {eta:.0f}s"
            + (f" tau {m['tau']:.2f}" if "tau" in m else "")
        )

    def log(self, m: dict) -> None:
        text = self.line(m)
        self.log_file.write(text + "\n")
        self.log_file.flush()
        self.jsonl.write(json.dumps({"time": time.time(), **m}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in m.items():
                if isinstance(value, int | float) and key != "step":
                    self.tb.add_scalar(f"train/{key}", value, m["step"])
        self.last_line = text

    def close(self) -> None:
        self.log_file.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
