"""A source drafter for the warm-start row of the recipe comparison: trained on one kind of a SmolLM2 proof's
conversations only (the chat half by default), so that the comparison's warm start fine-tunes a drafter made
for other data, as a user fine-tunes a released drafter for their own target's traffic.

    python -m experiments.smollm2.source --proof PROOF --out SOURCE --steps 500
    flashdraft compare --out OUT $(python -m experiments.smollm2.compare_args PROOF) --steps 1000 \\
        --variant scratch \\
        --variant warm:init_from=SOURCE/run/checkpoints/step_000500,optim.lr=1e-4,optim.warmup_ratio=0.01

Prepares OUT/data from the kind's conversations (as the proof's prepare stage does), trains the proof's
drafter settings (`experiments.smollm2.scales.H200`) for --steps, and prints the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proof", type=Path, required=True, help="a SmolLM2 proof directory after `regenerate`")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--kind", default="chat", help="the conversations kept: their id's prefix")
    args = ap.parse_args()

    from experiments.smollm2.scales import H200
    from flashdraft.config import resolve_config
    from flashdraft.data.prepare import PrepareOptions, prepare_dataset
    from flashdraft.demo.real_target import drafter_settings
    from flashdraft.model.checkpoint import latest_checkpoint
    from flashdraft.model.target import load_tokenizer
    from flashdraft.train.build import build_trainer

    target = args.proof / "target"
    tokenizer = load_tokenizer(target)
    data = args.out / "data"
    if not (data / "stats.json").is_file():
        args.out.mkdir(parents=True, exist_ok=True)
        kept = args.out / f"{args.kind}.jsonl"
        with (args.proof / "conversations.jsonl").open() as src, kept.open("w") as dst:
            dst.writelines(line for line in src if json.loads(line)["id"].startswith(f"{args.kind}-"))
        options = PrepareOptions(
            1024, num_proc=H200.prepare_procs, cache_dir=args.out / "cache", overwrite=True
        )
        stats = prepare_dataset(str(kept), tokenizer, data, options)
        print(f"{args.kind}: {stats['kept']} conversations, {stats['loss_tokens']} loss tokens")
        if not stats["kept"]:
            sys.exit(f"{args.proof / 'conversations.jsonl'}: no conversation's id starts with {args.kind}-")
    cfg = resolve_config(H200.preset, **drafter_settings(H200, tokenizer), max_steps=args.steps, seed=0)
    trainer = build_trainer(cfg, str(target), str(data), str(args.out / "run"), H200.device, overwrite=True)
    try:
        trainer.run()
    finally:
        trainer.close()
    print(latest_checkpoint(args.out / "run" / "checkpoints"))


if __name__ == "__main__":
    main()
