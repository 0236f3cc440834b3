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
    """The token ids `flashdraft eval` decodes: our tokenizer from the GGUF, its chat template applied."""
    from flashdraft.eval.spec import encode_prompt, read_prompts
    from flashdraft.model.target import load_tokenizer

    tokenizer = load_tokenizer(target)
    return [encode_prompt(tokenizer, c, thinking) for c in read_prompts(prompts, max_prompts)]


def _line(report: dict) -> str:
    return (
        f"engine tau {report['tau']:.3f} (acceptance {report['acceptance_rate']:.1%} of "
        f"{report['drafted']} drafted), {report['tokens_per_s_drafter']:.1f} tokens/s with the drafter, "
        f"{report['tokens_per_s_plain']:.1f} without: speedup {report['speedup']:.2f}x; "
        f"{report['identical_to_plain']} of {report['requests']} completions identical to plain decoding"
    )


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
    return None if isinstance(x, float) and not math.isfinite(x) else x


def engine_check_cmd(
    target: Path = typer.Option(..., help="the target's .gguf file, as llama-server serves it"),
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
) -> None:
    """Serve target and drafter with llama.cpp's DFlash speculative decoding at T = 0, then the target
    alone, over the prompts of `flashdraft eval`: the engine's tau, acceptance and tokens/s, as JSON."""
    from flashdraft.eval.engine import ServerError, ServerOptions, engine_check, find_server

    try:
        binary = find_server(server)
        for path in (target, drafter):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file")
        ids = _prompt_ids(target, prompts, max_prompts, thinking)
    except (ValueError, OSError) as e:
        _fail(str(e))
    # a context that holds the longest prompt, its completion and one draft past it; no more memory
    ctx = max(len(x) for x in ids) + max_new_tokens + draft_max + 16
    opts = ServerOptions(
        threads=threads, draft_max=draft_max, ctx_size=ctx, request_timeout_s=request_timeout
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _sigterm_as_interrupt():
            report = engine_check(binary, target, drafter, ids, max_new_tokens, opts, out.parent, seed)
    except ServerError as e:
        _fail(str(e), code=1)
    except KeyboardInterrupt:
        _fail("interrupted; llama-server stopped", code=130)
    report["settings"]["prompts"] = str(prompts)
    out.write_text(json.dumps({k: _finite(v) for k, v in report.items()}, indent=2))
    typer.echo(_line(report))
    typer.echo(f"report {out}")
