"""Per-phase timing of a training step: CUDA events on GPU (no host sync inside the step), the wall
clock on CPU. Disabled, it costs nothing, so the training step always carries it."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch


class PhaseTimer:
    def __init__(self, enabled: bool = False, device: torch.device | None = None, ranges: bool = False):
        """ranges: each phase is also a named range in a profiler's trace (`flashdraft bench --profile`)."""
        self.enabled = enabled
        self.ranges = ranges
        self.cuda = enabled and device is not None and device.type == "cuda"
        self.spans: dict[str, list] = defaultdict(list)

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        with torch.profiler.record_function(f"phase:{name}") if self.ranges else nullcontext():
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self.spans[name].append((start, end))
            else:
                t0 = time.perf_counter()
                yield
                self.spans[name].append(time.perf_counter() - t0)

    def reset(self) -> None:
        self.spans.clear()

    def milliseconds(self) -> dict[str, float]:
        """Total milliseconds per phase since the last reset (synchronises on GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(s.elapsed_time(e) for s, e in v) for k, v in self.spans.items()}
        return {k: 1000 * sum(v) for k, v in self.spans.items()}


NULL_TIMER = PhaseTimer(enabled=False)
