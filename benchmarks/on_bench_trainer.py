"""What overlap_check.py and weight_casts.py share: a measurement on the trainer `flashdraft bench` sets
up for a shape, run in place of the bench's own timing after its warm-up steps."""

import argparse

import flashdraft.bench as bench


def main(doc: str, experiment, iters: int) -> None:
    """--shape and --iters from the command line; experiment(iters) gives the function that stands in
    for the bench's measuring function (trainer, device, steps, warmup, profile)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--iters", type=int, default=iters)
    args = ap.parse_args()
    bench._drafter_bench = experiment(args.iters)
    bench.run_bench(args.shape, steps=1, warmup=3)
