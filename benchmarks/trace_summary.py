"""What a `flashdraft bench --profile` trace says: GPU time by kernel, idle time, and where the host waited.

    python benchmarks/trace_summary.py runs/prof/trace.json.gz [--steps 2] [--top 25]

Per step (the profile covers `--steps`, 2 by default): the span from the first kernel to the last, the
kernels' total and the idle rest; the kernels with most time; each phase's kernels (the bench's
DIR/phases.txt, flashdraft.bench.phase_table); and every host wait longer than 0.5 ms
(`cudaStreamSynchronize`, `cudaDeviceSynchronize`) with the ops it sat in: a wait inside a step leaves the
GPU idle while the host catches up afterwards.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict

from flashdraft.bench import phase_table

GPU_WORK = ("kernel", "gpu_memset", "gpu_memcpy")


def summarize(trace: dict, steps: int = 2, top: int = 25) -> dict:
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in GPU_WORK), key=lambda e: e["ts"])
    if not kernels:
        raise ValueError("no GPU kernels in the trace (was it profiled on a GPU?)")
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy = sum(e["dur"] for e in kernels)
    by_name, count = defaultdict(float), Counter()
    for e in kernels:
        by_name[e["name"]] += e["dur"]
        count[e["name"]] += 1
    ms = 1e-3 / steps  # trace times are microseconds
    return {
        "span_ms": span * ms,
        "kernels_ms": busy * ms,
        "idle_ms": (span - busy) * ms,
        "top": [
            (n, d * ms, count[n] // steps) for n, d in sorted(by_name.items(), key=lambda x: -x[1])[:top]
        ],
        "phases": phase_table(events, steps, device=True),
        "waits": _host_waits(events),
    }


def _host_waits(events: list[dict], min_us: float = 500.0) -> list[tuple[float, str]]:
    """(milliseconds, the ops enclosing it on its thread) for each long synchronize call."""
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    waits = []
    for w in events:
        if w.get("cat") != "cuda_runtime" or "Synchronize" not in w["name"] or w["dur"] < min_us:
            continue
        around = sorted(
            (o for o in ops if o.get("tid") == w.get("tid") and o["ts"] <= w["ts"] <= o["ts"] + o["dur"]),
            key=lambda o: o["ts"],
        )
        waits.append((w["dur"] / 1e3, " > ".join(o["name"] for o in around) or w["name"]))
    return waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="trace.json.gz (or .json) from `flashdraft bench --profile`")
    ap.add_argument("--steps", type=int, default=2, help="steps the profile covers")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        s = summarize(json.load(f), args.steps, args.top)
    print(
        f"per step: span {s['span_ms']:.1f} ms, kernels {s['kernels_ms']:.1f} ms, idle {s['idle_ms']:.1f} ms"
    )
    print("kernels (ms a step, launches a step):")
    for name, d, n in s["top"]:
        print(f"  {d:8.2f}  x{n:<4d} {name[:110]}")
    print(s["phases"], end="")
    print("host waits over 0.5 ms (whole profile):")
    for d, where in s["waits"]:
        print(f"  {d:8.2f}  {where[:140]}")


if __name__ == "__main__":
    main()
