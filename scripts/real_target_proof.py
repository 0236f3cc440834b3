"""The whole pipeline on a target trained here from scratch, at GPU scale (one H200, ~10 minutes).

No pretrained LLM can be downloaded on these machines, so the proof trains a ~100M-parameter Qwen3
target on the Python source of the installed packages (real code, hundreds of MB), with a BPE
tokenizer trained on the same text; builds prompts from held-out files; has the target rewrite
the responses (greedy, `data regenerate`'s local backend); trains a DFlash drafter with the
Trainer of `flashdraft train`; and measures tau with `flashdraft eval`'s engine against plain
decoding and the n-gram baseline. It is `flashdraft demo`'s flow (flashdraft.demo.pipeline) at
another scale.

    python scripts/real_target_proof.py --out runs/proof [--minutes 8]
    python scripts/real_target_proof.py --out /tmp/smoke --smoke   # minutes on a CPU, to check the flow
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from flashdraft.demo.pipeline import H200, run_pipeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="time budget of the whole run")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: check the flow only")
    args = ap.parse_args()
    scale = H200
    if args.smoke:
        scale = dataclasses.replace(
            H200,
            device="cpu",
            vocab_size=512,
            target=dict(hidden=64, layers=6, heads=4, kv_heads=2),
            target_batch=8,
            conversations=64,
            regen_batch=32,
            response_tokens=32,
            drafter={"drafter.num_layers": 1, "drafter.num_taps": 2, "data.seq_len": 512, "num_anchors": 32},
            eval_prompts=4,
            source_bytes=3_000_000,
        )
    summary = run_pipeline(args.out, args.minutes, scale)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
