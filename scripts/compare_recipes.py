"""Drafter recipes compared by served tau at equal training tokens (recipes.variants).

    # the SmolLM2 proof's target, data, drafter settings and eval prompts (after its prepare stage):
    python scripts/compare_recipes.py --out OUT --smollm2 /root/keep/proof --humaneval 64 --steps 2000 \\
        --variant today --variant distill:distill=1.0 --variant gamma:position_weights=gamma --minutes 9
    python scripts/compare_recipes.py --out OUT --minutes 9        # the next call continues it
    # any target and token dataset:
    python scripts/compare_recipes.py --out OUT --target DIR --data DIR --prompts code=code.jsonl \\
        --base drafter.num_layers=3 --variant today --variant layers6:drafter.num_layers=6 --steps 500

The first variant is the reference the others are compared with. Every variant trains the same steps on
the same micro-batches, side by side (one process each), then decodes every prompt set at T = 0 and
T = 1; the table is printed and written to OUT/table.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipes package
from recipes.proof import key_value  # noqa: E402
from recipes.variants import Comparison, open_comparison, parse_variant, print_comparison, run_comparison  # noqa: E402


def smollm2_parts(proof: Path, humaneval: int) -> dict:
    """Target, data, drafter settings and eval prompts of a SmolLM2 proof directory (scripts/smollm2_proof.py
    after its prepare stage): HumanEval's first problems and the held-out synthesized turns."""
    from flashdraft.data.humaneval import humaneval_prompts
    from flashdraft.demo.real_target import drafter_settings, prompt_split
    from flashdraft.model.target import load_tokenizer
    from recipes.smollm2 import H200

    if not (proof / "data").is_dir():
        raise ValueError(f"{proof} has no data/: run scripts/smollm2_proof.py --stop-after prepare first")
    _, held = prompt_split(proof, H200)
    prompts = {
        "humaneval": [r["messages"] for r in humaneval_prompts()[:humaneval]],
        "held_out": [r["messages"] for r in held],
    }
    base = drafter_settings(H200, load_tokenizer(proof / "target"))
    return dict(
        target=str(proof / "target"), data=str(proof / "data"), base=base, prompts=prompts,
        temperatures=H200.temperatures, max_new_tokens=H200.eval_tokens, preset=H200.preset,
        device=H200.device, cuda_graphs=H200.cuda_graphs, extra={"smollm2_proof": str(proof)},
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the comparison's directory")
    ap.add_argument("--minutes", type=float, default=9.0, help="time budget of this call")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]")
    ap.add_argument("--steps", type=int, help="optimizer steps of every variant")
    ap.add_argument("--smollm2", type=Path, metavar="PROOF", help="a SmolLM2 proof directory to compare on")
    ap.add_argument("--humaneval", type=int, default=64, help="with --smollm2: HumanEval problems")
    ap.add_argument("--target", help="target model directory")
    ap.add_argument("--data", help="token dataset directory (`flashdraft data prepare`)")
    ap.add_argument("--prompts", action="append", default=[], metavar="NAME=JSONL", help="a prompt set")
    ap.add_argument(
        "--base", action="append", default=[], metavar="KEY=VALUE", help="every variant's setting"
    )
    ap.add_argument("--preset", default="default")
    ap.add_argument("--max-new-tokens", type=int, help="tokens decoded per prompt (default 192)")
    ap.add_argument("--no-ngram", action="store_true", help="leave out prompt lookup's decoding")
    ap.add_argument("--device")
    ap.add_argument("--cuda-graphs", action="store_true")
    args = ap.parse_args()
    try:
        given = None
        if args.variant:
            if not args.steps:
                raise ValueError("--steps: the optimizer steps every variant trains")
            variants = dict(parse_variant(v) for v in args.variant)
            if len(variants) != len(args.variant):
                raise ValueError("two --variant options share a name")
            parts = smollm2_parts(args.smollm2, args.humaneval) if args.smollm2 else generic_parts(args)
            parts["base"] |= dict(key_value("--base", b, "drafter.num_layers=3") for b in args.base)
            parts["max_new_tokens"] = args.max_new_tokens or parts.get("max_new_tokens", 192)
            parts["ngram"] = not args.no_ngram
            given = Comparison(variants=variants, steps=args.steps, **parts)
        cmp = open_comparison(args.out, given)
    except ValueError as e:
        ap.error(str(e))
    table = run_comparison(cmp, args.out, args.minutes)
    if table is not None:
        print_comparison(table)


def generic_parts(args) -> dict:
    from flashdraft.eval.spec import read_prompts

    if not (args.target and args.data and args.prompts):
        raise ValueError("name --target, --data and at least one --prompts NAME=JSONL (or --smollm2 PROOF)")
    prompts = {}
    for item in args.prompts:
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--prompts {item!r}: expected NAME=JSONL")
        prompts[name] = read_prompts(path)
    return dict(
        target=args.target, data=args.data, base={}, prompts=prompts,
        preset=args.preset, device=args.device, cuda_graphs=args.cuda_graphs,
    )  # fmt: skip


if __name__ == "__main__":
    main()
