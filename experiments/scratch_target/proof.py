"""The whole pipeline on a target trained here from scratch, at GPU scale (one H200, under 10 minutes).

No pretrained LLM can be downloaded on these machines, so the proof trains a ~100M-parameter Qwen3
target on the Python source of the installed packages (real code), with a BPE tokenizer trained on
the same text; builds prompts from held-out files; has the target rewrite the responses (greedy,
`data regenerate`'s local backend); trains a DFlash drafter (3 layers, 5 taps) with `flashdraft
train`; measures tau with `flashdraft eval`'s engine at T = 0 and T = 1 against plain decoding and the
n-gram baseline; exports the drafter and decodes it with the reference `dflash` package. With
--ablations it also trains the same drafter without target features and with 3 taps, at the same time
as the main one (as many steps, all inside the same budget, so fewer than without).
Prints one table; writes OUT/proof.json. The flow is experiments/scratch_target/flow.py.

    python -m experiments.scratch_target.proof --out runs/proof [--minutes 9] [--ablations]
    python -m experiments.scratch_target.proof --out runs/proof --resume --ablations   # ablations on top
    python -m experiments.scratch_target.proof --out /tmp/smoke --smoke   # minutes on a CPU: the flow only
    python -m experiments.scratch_target.proof --out OUT --drafter drafter.num_layers=5 --step-ms 45
    python -m experiments.scratch_target.proof --out OUT --scale conversations=131072 \\
        --scale regen_batch=16384
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from experiments.scratch_target.flow import (
    H200,
    SMOKE,
    run_proof,
    with_drafter_overrides,
    with_scale_overrides,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=9.25, help="time budget of the whole run")
    ap.add_argument(
        "--ablations",
        action="store_true",
        help="after the main flow: drafters without target features and with 3 taps, and their tau",
    )
    ap.add_argument("--no-reference", action="store_true", help="skip the reference dflash package")
    ap.add_argument(
        "--resume", action="store_true", help="finish a killed proof in --out (keeps done stages)"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: check the flow only")
    ap.add_argument(
        "--stop-after-prepare",
        action="store_true",
        help="end once the target, the data and the eval prompts are written (run.sh trains the drafter)",
    )
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="evals on fixed-shape caches replayed as CUDA graphs (default: the scale's, on for the H200)",
    )
    ap.add_argument(
        "--eval-seconds",
        type=float,
        help="time kept for the evals after the drafter (default: the scale's)",
    )
    ap.add_argument("--eval-prompts", type=int, help="held-out prompts to decode (default: the scale's, 32)")
    ap.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change the drafter's `flashdraft train` config (repeatable), e.g. drafter.num_layers=5",
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        help="the drafter step time the budget plans with (default: the scale's, measured at its shapes)",
    )
    ap.add_argument(
        "--scale",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a field of the scale (repeatable), e.g. conversations=131072 regen_batch=16384",
    )
    args = ap.parse_args()
    scale = SMOKE if args.smoke else H200
    if args.cuda_graphs is not None:
        scale = dataclasses.replace(scale, cuda_graphs=args.cuda_graphs)
    if args.eval_seconds is not None:
        scale = dataclasses.replace(scale, proof_eval_s=args.eval_seconds)
    if args.eval_prompts is not None:
        scale = dataclasses.replace(scale, eval_prompts=args.eval_prompts)
    try:
        scale = with_scale_overrides(scale, args.scale)
        scale = with_drafter_overrides(scale, args.drafter, args.step_ms)
    except ValueError as e:
        ap.error(str(e))
    reference, prepare_only = not args.no_reference, args.stop_after_prepare
    run_proof(args.out, args.minutes, scale, args.ablations, reference, args.resume, prepare_only)


if __name__ == "__main__":
    main()
