"""`flashdraft compare`: a thin entry point over flashdraft.compare.

The main app registers it with `app.command("compare")(compare_cmd)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def compare_cmd(
    out: Path = typer.Option(..., help="the comparison's directory; run the command again to continue it"),
    variant: list[str] = typer.Option(
        [],
        metavar="NAME[:KEY=VALUE,...]",
        help="a variant: a name and its `flashdraft train` settings over --base, e.g. "
        "gamma:position_weights=gamma (repeat it; the first is the reference)",
    ),
    steps: int | None = typer.Option(None, min=1, help="optimizer steps every variant trains"),
    target: str | None = typer.Option(None, help="target model: local HF directory, hub id or .gguf file"),
    data: Path | None = typer.Option(None, help="token dataset directory from `flashdraft data prepare`"),
    prompts: list[str] = typer.Option(
        [], metavar="NAME=JSONL", help="a prompt set to decode, named (repeat it)"
    ),
    humaneval: int | None = typer.Option(
        None, min=1, help="also decode HumanEval's first N problems, as the prompt set 'humaneval'"
    ),
    base: list[str] = typer.Option(
        [], metavar="KEY=VALUE", help="a `flashdraft train` setting of every variant (repeat it)"
    ),
    preset: str = typer.Option("default", help="named preset the settings overlay"),
    max_new_tokens: int = typer.Option(192, min=1, help="tokens decoded per prompt"),
    ngram: bool = typer.Option(True, "--ngram/--no-ngram", help="also decode with prompt lookup, for scale"),
    plain: bool = typer.Option(
        False, "--plain", help="also decode with the target alone: each variant's wall-clock speedup"
    ),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda when visible)"),
    cuda_graphs: bool = typer.Option(
        False, "--cuda-graphs", help="decode with fixed-shape caches replayed as CUDA graphs"
    ),
    minutes: float | None = typer.Option(
        None,
        min=0.0,
        help="stop after this many minutes, each variant with a checkpoint (default: run to the end)",
    ),
) -> None:
    """Drafter variants compared by served tau at equal training tokens.

    Every variant trains --steps steps on the same micro-batches, side by side, one process each. Then
    each decodes every prompt set at T = 0 and T = 1. The table is printed and written to OUT/table.json.
    The same command with only --out (and --minutes) continues a comparison.
    """
    from flashdraft.compare import open_comparison, print_comparison, run_comparison

    try:
        given = None
        if variant:
            given = _comparison(
                variant, steps, target, data, prompts, humaneval, base, preset=preset, device=device,
                max_new_tokens=max_new_tokens, ngram=ngram, plain=plain, cuda_graphs=cuda_graphs,
            )  # fmt: skip
        cmp = open_comparison(out, given)
    except (ValueError, OSError) as e:
        _fail(str(e))
    try:
        table = run_comparison(cmp, out, minutes, say=typer.echo)
    except RuntimeError as e:
        _fail(str(e), code=1)
    if table is not None:
        print_comparison(table)


def _comparison(variants, steps, target, data, prompts, humaneval, base, **rest):
    """The `Comparison` the options name, checked for what every comparison needs."""
    from flashdraft.compare import Comparison, parse_settings, parse_variant

    if not steps:
        raise ValueError("--steps: the optimizer steps every variant trains")
    parsed = [parse_variant(v) for v in variants]
    names = [name for name, _ in parsed]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"--variant names must differ: {', '.join(map(repr, twice))} is given twice")
    named = dict(parsed)
    if not (target and data and (prompts or humaneval)):
        raise ValueError("name --target, --data and at least one --prompts NAME=JSONL (or --humaneval N)")
    settings = {}
    for item in base:
        settings |= parse_settings(item, f"--base {item!r}: expected KEY=VALUE, e.g. drafter.num_layers=3")
    return Comparison(
        target=target, data=str(data), base=settings, variants=named, steps=steps,
        prompts=_prompt_sets(prompts, humaneval), **rest,
    )  # fmt: skip


def _prompt_sets(items: list[str], humaneval: int | None) -> dict:
    """Set name -> message lists, from NAME=JSONL items and HumanEval's first `humaneval` problems."""
    from flashdraft.eval.spec import chat_messages, read_prompts

    sets = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--prompts {item!r}: expected NAME=JSONL")
        if name in sets:
            raise ValueError(f"two prompt sets are named {name!r}")
        sets[name] = read_prompts(path)
    if humaneval:
        from flashdraft.data.humaneval import humaneval_prompts

        if "humaneval" in sets:
            raise ValueError("--humaneval and --prompts humaneval=... name the same prompt set")
        sets["humaneval"] = [chat_messages(r) for r in humaneval_prompts()[:humaneval]]
    return sets
