"""`flashdraft engine-check`: the exported drafter served by llama.cpp, its tau and speed measured there.

The main app registers it with `app.command("engine-check")(engine_check_cmd)`.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
from pathlib import Path

import typer

from flashdraft.cli.eval import _fail


def _prompt_ids(target: Path, prompts: Path, max_prompts: int | None, thinking: bool) -> list[list[int]]:
    """The token ids `flashdraft eval` decodes: the target's tokenizer, its chat template applied."""
    from flashdraft.eval.spec import encode_prompt, read_prompts
    from flashdraft.model.target import load_tokenizer

    tokenizer = load_tokenizer(target)
    return [encode_prompt(tokenizer, c, thinking) for c in read_prompts(prompts, max_prompts)]


def _line(report: dict) -> str:
    line = (
        f"engine tau {report['tau']:.3f} (acceptance {report['acceptance_rate']:.1%} of "
        f"{report['drafted']} drafted), {report['tokens_per_s_drafter']:.1f} tokens/s with the drafter, "
        f"{report['tokens_per_s_plain']:.1f} without: speedup {report['speedup']:.2f}x"
    )
    if "identical_to_plain" in report:
        same = report["identical_to_plain"]
        line += f"; {same} of {report['requests']} completions identical to plain decoding"
    return line


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """A SIGTERM ends the command as Ctrl-C does: through the code that stops the server."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _finite(x):
    """x with every non-finite float in it (at any depth) as None, which JSON can hold."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _read_eval_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(report, dict) or "dflash" not in report:
        raise ValueError(f"{path}: not a `flashdraft eval` report (it has no dflash section)")
    return report


def _fmt(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def _comparison_lines(compare: dict) -> list[str]:
    """One summary line, then tau per prompt in columns."""
    tau = compare["tau"]
    names = list(tau)
    summary = ", ".join(f"{name} {_fmt(tau[name])}" for name in names)
    lines = [
        f"tau over {compare['prompts_measured']} prompts: {summary}; "
        f"engine vs ours {compare['engine_vs_ours']:+.1%}",
        "prompt " + " ".join(f"{name:>9}" for name in names),
    ]
    for i, row in enumerate(compare["per_prompt"]):
        lines.append(f"{i:>6} " + " ".join(f"{_fmt(row[name]):>9}" for name in names))
    return lines


def engine_check_cmd(
    target: Path = typer.Option(
        ...,
        help="the target: a .gguf file, or a Hugging Face directory (Llama, Mistral, Qwen2, Qwen3, Gemma 3), "
        "which is converted to a .gguf next to the report",
    ),
    drafter: Path = typer.Option(..., help="the drafter's .gguf file (`flashdraft export --format gguf`)"),
    prompts: Path = typer.Option(..., help='JSONL of {"messages": [...]} or {"prompt": "..."} records'),
    out: Path = typer.Option(..., help="report path, e.g. REPORT.json; the servers' logs go next to it"),
    max_prompts: int | None = typer.Option(None, min=1, help="use the first N prompts only"),
    max_new_tokens: int = typer.Option(256, min=1, help="new tokens per prompt at most"),
    threads: int = typer.Option(2, min=1, help="CPU threads for the target and for the drafter"),
    draft_max: int = typer.Option(15, min=1, help="tokens drafted per step at most (the block size - 1)"),
    thinking: bool = typer.Option(
        False, "--thinking/--no-thinking", help="chat template's enable_thinking, as in `flashdraft eval`"
    ),
    server: Path | None = typer.Option(
        None,
        help="llama-server binary (default: $FLASHDRAFT_LLAMA_SERVER, else what `make llama-server` builds)",
    ),
    request_timeout: float = typer.Option(300.0, min=1.0, help="seconds one completion may take"),
    seed: int = typer.Option(0, help="the requests' sampling seed"),
    temperature: float = typer.Option(
        0.0, min=0.0, help="0: greedy; > 0: samples of softmax(logits / T), as `flashdraft eval` draws them"
    ),
    compare: Path | None = typer.Option(
        None,
        help="a `flashdraft eval` REPORT.json over the same prompts and settings: its tau (and the reference "
        "package's) beside the engine's, per prompt",
    ),
) -> None:
    """Serve target and drafter with llama.cpp's DFlash speculative decoding, then the target alone, over
    the prompts of `flashdraft eval`: the engine's tau, acceptance and tokens/s, as JSON."""
    from flashdraft.eval.engine import (
        ServerError,
        ServerOptions,
        beside_eval,
        check_dflash_drafter,
        check_dflash_target,
        comparison_problems,
        engine_check,
        find_server,
    )
    from flashdraft.export.gguf_target import served_target

    try:
        if Path(target).suffix == ".gguf":  # before its tokenizer is read: a drafter's fails obscurely
            check_dflash_target(Path(target))
        check_dflash_drafter(drafter)
        binary = find_server(server)
        ids = _prompt_ids(target, prompts, max_prompts, thinking)
        if compare is not None:
            eval_report = _read_eval_report(compare)
            settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "thinking": thinking}
            problems = comparison_problems(
                eval_report, prompts, len(ids), settings | {"block_size": draft_max + 1}
            )
            if problems:
                raise ValueError(f"{compare} measured other decoding:\n  " + "\n  ".join(problems))
        served = served_target(target, out.parent)
    except (ValueError, OSError) as e:
        _fail(str(e))
    if served != target:
        typer.echo(f"target {target} converted for llama-server: {served}")
    # a context that holds the longest prompt, its completion and one draft past it; no more memory
    ctx = max(len(x) for x in ids) + max_new_tokens + draft_max + 16
    opts = ServerOptions(
        threads=threads, draft_max=draft_max, ctx_size=ctx, request_timeout_s=request_timeout
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _sigterm_as_interrupt():
            report = engine_check(
                binary, served, drafter, ids, max_new_tokens, opts, out.parent, seed, temperature
            )
    except ServerError as e:
        _fail(str(e), code=1)
    except KeyboardInterrupt:
        _fail("interrupted; llama-server stopped", code=130)
    report["settings"] |= {"prompts": str(prompts), "thinking": thinking}
    if served != target:
        report["settings"]["converted_from"] = str(target)
    if compare is not None:
        report["compare"] = {"eval_report": str(compare), **beside_eval(report, eval_report)}
    out.write_text(json.dumps(_finite(report), indent=2))
    typer.echo(_line(report))
    if compare is not None:
        typer.echo("\n".join(_comparison_lines(report["compare"])))
    typer.echo(f"report {out}")
