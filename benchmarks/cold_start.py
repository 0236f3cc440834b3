"""Cold first steps: `flashdraft bench` for each shape in a process of its own on an empty inductor
and triton cache, so every graph and kernel compiles as on a fresh machine. Prints one line a run
(first step, graphs compiled, the largest compile timers) and writes each run's bench JSON to OUT.

    python benchmarks/cold_start.py --out runs/cold --shapes qwen3-8b,llama3-8b \\
        [--variant late_pool:TORCH_WARM_POOL=0] [--budget-s 540] [-- more bench options]

A variant is NAME:KEY=VALUE[,KEY=VALUE]: the same runs with those environment variables (the runs
alternate variants shape by shape). --budget-s stops starting runs that would end past it, at the
longest run seen so far.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, assignments = text.partition(":")
    env = dict(a.split("=", 1) for a in assignments.split(",") if a)
    return name, env


def run_once(shape: str, env: dict[str, str], out: Path, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = (
            os.environ
            | env
            | {
                "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
                "TRITON_CACHE_DIR": f"{cache}/triton",
            }
        )
        cmd = [sys.executable, "-m", "flashdraft.cli.main", "bench", "--shape", shape, "--steps", str(steps)]
        cmd += ["--warmup", "2", "--json", str(out), *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    out.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": last, "wall": wall}
    return json.loads(out.read_text()) | {"wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="qwen3-8b,llama3-8b,qwen3-30b-a3b,gpt-oss-20b")
    ap.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... (default: none)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=None)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    variants = [("default", {})] + [parse_variant(v) for v in args.variant]
    start, longest = time.perf_counter(), 0.0
    for shape in args.shapes.split(","):
        for name, env in variants:
            if args.budget_s and time.perf_counter() - start + longest > args.budget_s:
                print(f"{shape} {name}: skipped, out of budget", flush=True)
                continue
            r = run_once(shape, env, args.out / f"{shape}.{name}.json", args.steps, extra)
            longest = max(longest, r["wall"])
            if "error" in r:
                print(f"{shape} {name}: FAILED {r['error']}", flush=True)
                continue
            timers = ", ".join(f"{k} {v:.1f}" for k, v in list(r["compile_seconds"].items())[:6])
            print(
                f"{shape} {name}: first step {r['first_step_s']:.1f} s, start-up {r['startup_s']:.1f} s, "
                f"step {r['step_ms']:.1f} ms, MFU {100 * r['mfu']:.1f}%, wall {r['wall']:.0f} s | "
                f"{r['compile_report'].split('(')[0].strip()} | {timers}",
                flush=True,
            )


if __name__ == "__main__":
    main()
