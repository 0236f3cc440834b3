"""Where a bench step's peak memory is reached: each phase's peak allocation, on a GPU.

    python benchmarks/memory_phases.py --shape qwen3-8b --architecture dflash2 [--steps 3]

Runs `flashdraft bench`'s step with every phase timer also reading torch.cuda.max_memory_allocated at
the phase's end and resetting it, so each phase reports the most it held. The readings synchronise the
GPU, so no times are reported. Prints, per phase, the largest peak over the steps in GiB, and what is
still allocated after the last step (the weights and the optimizer's state).
"""

import argparse
import contextlib
from collections import defaultdict

import torch

from flashdraft.bench import run_bench
from flashdraft.train import timing

peaks: dict[str, float] = defaultdict(float)


@contextlib.contextmanager
def _phase(self, name: str):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.synchronize()
    peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() / 2**30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--architecture", default="dflash")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    timing.PhaseTimer.__call__ = _phase
    run_bench(
        args.shape, rows_per_batch=args.rows, steps=args.steps, warmup=2, architecture=args.architecture
    )
    after = torch.cuda.memory_allocated() / 2**30
    print(
        f"{args.shape} {args.architecture}: {after:.2f} GiB allocated after the last step; each phase's peak:"
    )
    for name, gib in peaks.items():
        print(f"  {name:16s} {gib:7.2f} GiB")


if __name__ == "__main__":
    main()
