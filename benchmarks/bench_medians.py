"""`flashdraft bench` for several configurations, each run N times interleaved (so that a drifting machine
hits all alike), and one table of their medians: step, context tokens a second, MFU (against the matmul
rate measured in each run), the target forward's share of peak, memory, and the target attention the
run used, and the last measured step's training loss (the seeds fix the weights and batches: two
revisions whose numerics agree give the same).

    python benchmarks/bench_medians.py --out runs/medians --runs 3 \\
        --config qwen3-8b:--shape,qwen3-8b --config qwen3-8b-1doc:--shape,qwen3-8b,--documents,1 \\
        [--budget-s 540] [-- options for every run, e.g. --steps 20]

A configuration is NAME:ARG,ARG,... (the bench's own options, comma-separated). Each run's JSON and log
go to OUT/NAME.K.json and .log; a rerun with the same OUT skips the runs already there, so a series cut
short by --budget-s goes on where it stopped.

--peer NAME:ARG,ARG,... (repeatable) also runs the peer, vLLM's speculators drafter step alone
(benchmarks/peer_step.py with those options; speculators must be importable), once in each round after
the configurations, or in the first --peer-runs rounds only, into OUT/peer-NAME.K.json; its row in the
table has no target forward. The options after -- that peer_step.py shares with the bench (--steps,
--warmup, the shape's) reach it too, before its own. For example `--peer dflash:--architecture,dflash --
--steps 20`.

--source NAME:DIR (repeatable) runs configuration NAME on the flashdraft package under DIR instead of the
installed one: two revisions side by side on one machine, for example the previous commit's
(`git archive REV src | tar -x -C base`, then `--config base:ARGS --config head:ARGS --source base:base/src`).
"""

import argparse
import json
import os
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
    ("last_loss", "last loss", "{:.5f}"),
)


PEER = Path(__file__).with_name("peer_step.py")
# the options after -- that peer_step.py also takes (each with a value)
PEER_SHARED = ("--shape", "--seq-len", "--anchors", "--block-size", "--rows-per-batch", "--documents",
               "--drafter-layers", "--steps", "--warmup", "--device", "--architecture")  # fmt: skip


def shared_with_peer(common: list[str]) -> list[str]:
    """Those of the common options (and their values) that peer_step.py takes as well."""
    out, items = [], iter(common)
    for a in items:
        if a.split("=")[0] in PEER_SHARED:
            out += [a] if "=" in a else [a, next(items, "")]
    return out


def run_once(
    name: str, args: list[str], k: int, out: Path, common: list[str], peer: bool = False, source: str = ""
) -> None:
    path = out / f"{name}.{k}.json"
    if path.is_file():
        return
    if peer:
        cmd = [sys.executable, str(PEER), *shared_with_peer(common), *args, "--json", str(path)]
    else:
        cmd = [sys.executable, "-m", "flashdraft.cli.main", "bench", *args, *common, "--json", str(path)]
    env = os.environ.copy()
    if source:  # this package first on the path
        paths = (str(Path(source).resolve()), env.get("PYTHONPATH"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    path.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        print(f"{name} run {k}: failed: {last}", flush=True)


def table(out: Path, names: list[str]) -> list[str]:
    lines = ["| config | runs | " + " | ".join(h for _, h, _ in COLUMNS) + " | target attention |"]
    lines.append("|---" * (len(COLUMNS) + 3) + "|")
    for name in names:
        runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}.*.json"))]
        for r in runs:  # the last measured step's loss: two revisions of one shape should agree
            r["last_loss"] = r["losses"][-1] if r.get("losses") else None
        if not runs:
            lines.append(f"| {name} | 0 |" + " |" * (len(COLUMNS) + 1))
            continue
        cells = []
        for key, _, fmt in COLUMNS:
            values = [r[key] for r in runs if r.get(key) is not None]
            cells.append(fmt.format(statistics.median(values)) if values else "")
        attention = sorted({_attention(r) for r in runs})
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + f" | {', '.join(attention)} |")
    return lines


def _attention(run: dict) -> str:
    if "peer" in run:  # peer_step.py's: no target
        return "none (peer drafter alone)"
    return run.get("settings", {}).get("target_attention", "?")


def named_args(items: list[str], option: str, error) -> dict[str, list[str]]:
    """NAME:ARG,ARG,... items as {NAME: [ARG, ...]}."""
    named = {}
    for item in items:
        name, _, rest = item.partition(":")
        if not name or "." in name or "/" in name:
            error(f"{option} {item!r}: NAME:ARG,ARG,... with a NAME free of '.' and '/'")
        named[name] = [a for a in rest.split(",") if a]
    return named


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", action="append", required=True, help="NAME:ARG,ARG,...")
    ap.add_argument("--peer", action="append", default=[], help="NAME:ARG,ARG,... for peer_step.py")
    ap.add_argument("--source", action="append", default=[], help="NAME:DIR, a package to run NAME on")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peer-runs", type=int, help="runs of each peer, in the first rounds (default: --runs)")
    ap.add_argument("--budget-s", type=float, help="start no run after this many seconds")
    args, common = ap.parse_known_args()
    common = [c for c in common if c != "--"]
    configs = named_args(args.config, "--config", ap.error)
    sources = dict(item.partition(":")[::2] for item in args.source)
    for name, src in sources.items():
        if name not in configs or not (Path(src) / "flashdraft").is_dir():
            ap.error(f"--source {name}:{src}: NAME must be a --config and DIR must hold a flashdraft package")
    peers = {f"peer-{name}": a for name, a in named_args(args.peer, "--peer", ap.error).items()}
    runs = [(name, a, False) for name, a in configs.items()] + [(name, a, True) for name, a in peers.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for k in range(1, args.runs + 1):
        for name, run_args, peer in runs:
            if peer and k > (args.runs if args.peer_runs is None else args.peer_runs):
                continue
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                break
            run_once(name, run_args, k, args.out, common, peer, sources.get(name, ""))
    print("\n".join(table(args.out, [name for name, _, _ in runs])))


if __name__ == "__main__":
    main()
