"""Layouts compared on one multi-GPU machine: `flashdraft bench --nproc N --layout L` for each layout,
first on an empty compile cache, then again on the cache the first run filled, and one table.

    python benchmarks/layouts.py --layouts colocated:2,split:1:1 --out OUT [--shape qwen3-8b]

A layout is `colocated:N` (N ranks each holding target and drafter) or `split:T:D`. Each run's JSON
and log are written under OUT; the table gives total and per-GPU context tokens/s, MFU, busy
fractions, the largest rank's peak memory and the cold and warm first step. Every run trains under
the fail_on_recompile stance after its warm-up step, so a run that finished did not recompile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def world_of(layout: str) -> tuple[str, int]:
    kind, *parts = layout.split(":")
    if kind == "colocated" and len(parts) == 1:
        return "colocated", int(parts[0])
    if kind == "split" and len(parts) == 2:
        return layout, int(parts[0]) + int(parts[1])
    raise SystemExit(f"--layouts: {layout!r} is neither colocated:N nor split:T:D")


def run(layout: str, out: Path, cache: Path, tag: str, extra: list[str]) -> dict | None:
    name, nproc = world_of(layout)
    path = out / f"{layout.replace(':', '_')}_{tag}"
    cmd = [sys.executable, "-m", "flashdraft.cli.main", "bench", "--nproc", str(nproc), "--layout", name,
           "--json", f"{path}.json", *extra]  # fmt: skip
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    with open(f"{path}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1200)
    if proc.returncode != 0:
        print(f"{layout} ({tag}): exit {proc.returncode}, see {path}.log", flush=True)
        return None
    return json.loads(Path(f"{path}.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="colocated:2,split:1:1")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args, extra = ap.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = ["--shape", args.shape, "--steps", str(args.steps), "--warmup", str(args.warmup), *extra]
    rows = []
    for layout in args.layouts.split(","):
        cache = Path(tempfile.mkdtemp(prefix="flashdraft-inductor-"))  # empty: the cold start
        cold = run(layout, args.out, cache, "cold", extra)
        warm = run(layout, args.out, cache, "warm", extra) if cold else None
        rows.append((layout, cold, warm))
        if warm:
            print(line(layout, cold, warm), flush=True)
    header = ("| layout | GPUs | ctx tok/s | per GPU | MFU | busy drafter / target | peak mem | "
              "first step cold / warm |")  # fmt: skip
    table = [header, "|" + "---|" * 8] + [line(lay, c, w) for lay, c, w in rows if w]
    (args.out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


def line(layout: str, cold: dict, warm: dict) -> str:
    busy = "-" if warm["drafter_busy"] is None else f"{warm['drafter_busy']:.0%} / {warm['target_busy']:.0%}"
    return (
        f"| {layout} | {warm['world_size']} | {warm['ctx_tok_s']:,.0f} | "
        f"{warm['ctx_tok_s'] / warm['world_size']:,.0f} | {100 * warm['mfu']:.1f}% | {busy} | "
        f"{warm['peak_mem_gib']:.1f} GiB | {cold['first_step_s']:.1f} s / {warm['first_step_s']:.1f} s |"
    )


if __name__ == "__main__":
    main()
