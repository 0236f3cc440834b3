"""`flashdraft eval` and `flashdraft export`: thin entry points over flashdraft.eval and flashdraft.export.

The main app registers them with `app.command("eval")(eval_cmd)` and `app.command("export")(export_cmd)`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tempfile
from pathlib import Path

import typer
import yaml

from flashdraft.data.humaneval import STOPS as HUMANEVAL_STOPS


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def eval_cmd(
    target: str = typer.Option(..., help="target model: local HF directory, hub id or .gguf file"),
    drafter: Path = typer.Option(..., help="drafter checkpoint directory (z-lab layout)"),
    prompts: Path = typer.Option(..., help='JSONL of {"messages": [...]} or {"prompt": "..."} records'),
    out: Path = typer.Option(
        ..., help="report path, e.g. REPORT.json; the plot is written next to it (.png)"
    ),
    max_new_tokens: int = typer.Option(256, min=1, help="new tokens per prompt at most"),
    temperature: float = typer.Option(0.0, min=0.0, help="0: greedy; > 0: lossless speculative sampling"),
    draft_sampling: str = typer.Option(
        "auto",
        help="the drafts at T > 0: argmax (one-hot proposals), sample (DFlash: each position drawn from "
        "softmax(drafter logits / T); DFlash2: the selector's path sampled; verified with their "
        "probabilities), or auto (argmax for DFlash, sample for DFlash2)",
    ),
    block_size: int | None = typer.Option(
        None, min=2, help="tokens per verify block (default: the drafter's)"
    ),
    thinking: bool = typer.Option(
        False,
        "--thinking/--no-thinking",
        help="chat template's enable_thinking: the mode the drafter was trained in",
    ),
    max_prompts: int | None = typer.Option(None, min=1, help="use the first N prompts only"),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda when visible)"),
    seed: int = typer.Option(0, help="sampling seed (T > 0)"),
    cuda_graphs: bool = typer.Option(
        False, help="fixed-shape caches; on a GPU every forward replays as a CUDA graph (less host time)"
    ),
    target_attention: str = typer.Option(
        "auto", help="the target's attention: auto (sdpa where the model supports it, else eager), or a name"
    ),
    stop: list[str] = typer.Option(
        [],
        help="end a decoding once its new text holds this string (repeatable; \\n and \\t are read as a "
        "newline and a tab), as a completions API's stop",
    ),
    humaneval_stops: bool = typer.Option(
        False,
        "--humaneval-stops",
        help="add HumanEval's completion stops (the Codex paper's: \\nclass \\ndef \\n# \\nif \\nprint), "
        "for a base model continuing HumanEval's prompts",
    ),
    reference: bool = typer.Option(
        False,
        help="also decode with the reference `dflash` package (pip install --no-deps dflash==0.1.0) on the "
        "z-lab export, and count the prompts where its tau equals ours (T = 0 only)",
    ),
) -> None:
    """Speculative decoding with target + drafter: tau, per-position acceptance, speedup vs plain decoding
    and vs prompt lookup (n-gram), written as a JSON report with a plot."""
    from flashdraft.eval.report import compare_methods, print_table, write_report
    from flashdraft.eval.spec import check_draft_sampling, read_prompts

    if reference and temperature > 0:
        _fail("--reference compares greedy decoding: use it with --temperature 0")
    stops = [unescape(t) for t in stop] + (list(HUMANEVAL_STOPS) if humaneval_stops else [])
    if reference and stops:
        _fail("--reference: the reference package stops at end-of-sequence tokens only; run it without stops")
    if any(not t for t in stops):
        _fail("--stop: an empty stop string would end every decoding at once")
    try:
        check_draft_sampling(draft_sampling, temperature)
    except ValueError as e:
        _fail(f"--draft-sampling {draft_sampling}: {e}")
    if reference and importlib.util.find_spec("dflash") is None:
        _fail("--reference needs the reference package: pip install --no-deps dflash==0.1.0")
    try:
        conversations = read_prompts(prompts, max_prompts)
        report = compare_methods(
            target,
            drafter,
            conversations,
            max_new_tokens,
            temperature,
            block_size,
            thinking,
            device,
            seed,
            progress=lambda i, n: typer.echo(f"prompt {i}/{n}", err=True),
            cuda_graphs=cuda_graphs,
            attention=target_attention,
            draft_sampling=draft_sampling,
            stop_strings=stops,
        )
    except (ValueError, FileNotFoundError, OSError) as e:
        _fail(str(e))
    report["settings"]["prompts"] = str(prompts)
    if reference:
        report["reference"] = _reference(report, target, drafter, conversations, thinking, max_new_tokens)
    json_path, png_path = write_report(report, out)
    print_table(report)
    if reference:
        ref = report["reference"]
        typer.echo(
            f"reference dflash: tau {ref['tau']:.3f} against ours {ref['our_tau']:.3f}, "
            f"equal on {ref['samples_with_our_tau']} of {len(ref['tau_per_sample'])} prompts"
        )
    typer.echo(f"report {json_path}, plot {png_path}")


def _reference(report: dict, target: str, drafter: Path, conversations, thinking: bool, max_new: int) -> dict:
    """The reference package's tau beside ours, on the prompts and settings of `report`."""
    from flashdraft.eval.reference import reference_beside_ours
    from flashdraft.eval.spec import encode_prompt
    from flashdraft.model.target import load_tokenizer

    tokenizer = load_tokenizer(target)
    ids = [encode_prompt(tokenizer, c, thinking) for c in conversations]
    with tempfile.TemporaryDirectory() as tmp:
        return reference_beside_ours(
            drafter,
            target,
            ids,
            report["dflash"]["tau_per_sample"],
            max_new,
            report["settings"]["device"],
            Path(tmp) / "zlab",
        )


def unescape(text: str) -> str:
    """A stop string as typed: \\n, \\t and \\\\ read as a newline, a tab and a backslash."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def _run_target(ckpt: Path) -> str | None:
    """The target the checkpoint records (`flashdraft_target` in its config.json), or else the one in
    RUN/config.yaml for a checkpoint RUN/checkpoints/step_N, if any."""
    recorded = ckpt / "config.json"
    if recorded.is_file():
        target = (json.loads(recorded.read_text()).get("flashdraft_target") or {}).get("name_or_path")
        if target:
            return target
    config = ckpt.resolve().parent.parent / "config.yaml"
    if not config.is_file():
        return None
    saved = yaml.safe_load(config.read_text()) or {}
    return (saved.get("run") or {}).get("target") or saved.get("target")  # top level: older runs


def export_cmd(
    ckpt: Path = typer.Argument(
        ..., help="drafter checkpoint directory (z-lab layout), e.g. RUN/checkpoints/step_N"
    ),
    fmt: str = typer.Option(
        "zlab", "--format", help="zlab (SGLang, vLLM, dflash), speculators (vLLM) or gguf (llama.cpp)"
    ),
    out: Path = typer.Option(
        ..., help="output directory (created; must be empty if it exists); for gguf the .gguf file"
    ),
    target: str | None = typer.Option(
        None,
        help="speculators: the verifier's hub id or path; gguf: the target's .gguf file, or its Hugging Face "
        "directory, converted to a .gguf next to --out (default: the target the checkpoint records)",
    ),
    gguf_type: str = typer.Option(
        "bf16", help="gguf: the drafter's matrices as bf16 (llama.cpp's converter), f32, f16 or q8_0"
    ),
) -> None:
    """Validate a checkpoint and write it in an engine's layout: config.json + model.safetensors, bf16,
    or one GGUF file for llama.cpp."""
    from flashdraft.export.formats import export_checkpoint
    from flashdraft.export.gguf_target import served_target

    verifier = target or (_run_target(ckpt) if fmt in ("speculators", "gguf") else None)
    try:
        if fmt == "gguf" and verifier:  # the drafter's file takes its tokenizer from the served target's
            served = served_target(verifier, out.parent)
            if str(served) != verifier:
                typer.echo(f"target {verifier} converted for llama-server: {served}")
            verifier = str(served)
        path = export_checkpoint(ckpt, fmt, out, verifier, gguf_type)
    except (ValueError, OSError) as e:
        _fail(str(e))
    typer.echo(f"exported {fmt} checkpoint to {path}")
