"""`flashdraft bench` for several configurations, each run N times interleaved (so that a drifting machine
hits all alike), and one table of their medians: step, context tokens a second, MFU (against the matmul
rate measured in each run), the target forward's share of peak, memory, and the target attention the
run used.

    python benchmarks/bench_medians.py --out runs/medians --runs 3 \\
        --config qwen3-8b:--shape,qwen3-8b --config qwen3-8b-1doc:--shape,qwen3-8b,--documents,1 \\
        [--budget-s 540] [-- options for every run, e.g. --steps 20]

A configuration is NAME:ARG,ARG,... (the bench's own options, comma-separated). Each run's JSON and log
go to OUT/NAME.K.json and .log; a rerun with the same OUT skips the runs already there, so a series cut
short by --budget-s goes on where it stopped.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

COLUMNS = (
    ("step_ms", "step ms", "{:.1f}"),
    ("ctx_tok_s", "context tok/s", "{:,.0f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("target_forward_mfu", "target fwd", "{:.1%}"),
    ("peak_mem_gib", "GiB", "{:.1f}"),
)


def run_once(name: str, args: list[str], k: int, out: Path, common: list[str]) -> None:
    path = out / f"{name}.{k}.json"
    if path.is_file():
        return
    cmd = [sys.executable, "-m", "flashdraft.cli.main", "bench", *args, *common, "--json", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        print(f"{name} run {k}: failed: {last}", flush=True)


def table(out: Path, names: list[str]) -> list[str]:
    lines = ["| config | runs | " + " | ".join(h for _, h, _ in COLUMNS) + " | target attention |"]
    lines.append("|---" * (len(COLUMNS) + 3) + "|")
    for name in names:
        runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}.*.json"))]
        if not runs:
            lines.append(f"| {name} | 0 |" + " |" * (len(COLUMNS) + 1))
            continue
        cells = []
        for key, _, fmt in COLUMNS:
            values = [r[key] for r in runs if r.get(key) is not None]
            cells.append(fmt.format(statistics.median(values)) if values else "")
        attention = sorted({r.get("settings", {}).get("target_attention", "?") for r in runs})
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + f" | {', '.join(attention)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", action="append", required=True, help="NAME:ARG,ARG,...")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget-s", type=float, help="start no run after this many seconds")
    args, common = ap.parse_known_args()
    common = [c for c in common if c != "--"]
    configs = {}
    for item in args.config:
        name, _, rest = item.partition(":")
        if not name or "." in name or "/" in name:
            ap.error(f"--config {item!r}: NAME:ARG,ARG,... with a NAME free of '.' and '/'")
        configs[name] = [a for a in rest.split(",") if a]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for k in range(1, args.runs + 1):
        for name, bench_args in configs.items():
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                break
            run_once(name, bench_args, k, args.out, common)
    print("\n".join(table(args.out, list(configs))))


if __name__ == "__main__":
    main()
