"""The evaluation report: tau and acceptance statistics, speed, a plot and a terminal table.

Figures are computed as the reference `dflash` benchmark computes them, so they compare with
published ones: tau is the mean acceptance length per sample, then over samples; a sample's time per
output token (TPOT) is its decode time over the tokens decoded after the first (time to first token
excluded), averaged over samples; speedup = TPOT of plain autoregressive decoding / TPOT of the method,
all three measured by the same loop (`flashdraft.eval.spec.generate`).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flashdraft.eval.spec import (
    METHODS,
    Generation,
    StopText,
    check_drafter_fits,
    decoding_target,
    encode_prompt,
    mean_tau,
    resolve_draft_sampling,
    run_methods,
)
from flashdraft.model.target import default_device, stop_token_ids

TAU_DEFINITION = (
    "acceptance length = tokens a verify cycle commits (accepted drafts + 1 bonus token, cut at a stop "
    "token, a stop string or the token budget), in [1, B]; tau = its mean per sample, then the mean over "
    "samples; the block shrinks to the remaining budget near the end, as in the reference dflash package"
)
SPECULATIVE = ("dflash", "ngram")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _json_number(x: float | None) -> float | None:
    """Seven significant digits (a time per token of 0.000776 s has three at six decimals)."""
    return None if x is None or not math.isfinite(x) else float(f"{x:.7g}")


def _tpot(gens: list[Generation]) -> float:
    return _mean([g.decode_s / (len(g.tokens) - 1) for g in gens if len(g.tokens) > 1])


def acceptance_by_position(gens: list[Generation], block_size: int) -> list[float | None]:
    """Per draft slot k = 1..B-1: the fraction of cycles that drafted slot k in which it was accepted
    (so that at least k drafts were); None where no cycle drafted slot k."""
    cycles = [(v, a) for g in gens for v, a in zip(g.verify_sizes, g.accept_lengths, strict=True)]
    rates = []
    for k in range(1, block_size):
        drafted = [a for v, a in cycles if v > k]
        rates.append(_json_number(sum(a > k for a in drafted) / len(drafted)) if drafted else None)
    return rates


def tau_stderr(taus: list[float]) -> float:
    """Standard error of the mean over samples (sample standard deviation / sqrt(n)); nan below 2."""
    valid = [t for t in taus if not math.isnan(t)]
    return statistics.stdev(valid) / math.sqrt(len(valid)) if len(valid) >= 2 else math.nan


def tau_ratio(numerator: list[float], denominator: list[float], resamples: int = 2000) -> dict:
    """mean(numerator) / mean(denominator) over the samples both measured, with a 95% interval from
    a paired bootstrap over samples (seeded: the same figures give the same interval). A dozen
    prompts leave a ratio of taus uncertain by tenths, which a point figure hides."""
    pairs = [
        (a, b) for a, b in zip(numerator, denominator, strict=True) if not (math.isnan(a) or math.isnan(b))
    ]
    if not pairs:
        return {"ratio": None, "ci95": None, "samples": 0}
    ratio = lambda ps: sum(a for a, _ in ps) / sum(b for _, b in ps)  # noqa: E731
    rng = random.Random(0)
    draws = sorted(ratio(rng.choices(pairs, k=len(pairs))) for _ in range(resamples))
    lo, hi = draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]
    return {
        "ratio": _json_number(ratio(pairs)),
        "ci95": [_json_number(lo), _json_number(hi)],
        "samples": len(pairs),
    }


def method_summary(gens: list[Generation], block_size: int) -> dict:
    """Acceptance and speed of one method over all samples."""
    lengths = [a for g in gens for a in g.accept_lengths]
    tpot = _tpot(gens)
    return {
        "tau": _json_number(mean_tau([g.tau for g in gens])),
        "tau_stderr": _json_number(tau_stderr([g.tau for g in gens])),
        "tau_per_sample": [_json_number(g.tau) for g in gens],
        "cycles": len(lengths),
        "accept_length_histogram": {str(k): lengths.count(k) for k in range(1, block_size + 1)},
        "acceptance_by_position": acceptance_by_position(gens, block_size),
        "output_tokens": sum(len(g.tokens) for g in gens),
        "time_to_first_token_s": _json_number(_mean([g.ttft_s for g in gens])),
        "time_per_output_token_s": _json_number(tpot),
        "tokens_per_s": _json_number(1 / tpot if tpot > 0 else math.nan),
    }


PROMPT_BUCKETS = (256, 1024, 4096, 16384)  # tau by prompt length: below each bound, and beyond the last


def bucket_name(length: int) -> str:
    lower = 0
    for bound in PROMPT_BUCKETS:
        if length < bound:
            return f"{lower}-{bound - 1}"
        lower = bound
    return f">={lower}"


def tau_by_prompt_length(results: dict[str, list[Generation]], prompt_lengths: list[int]) -> dict:
    """Per prompt-length bucket (tokens): how many prompts, and each speculative method's mean tau over
    them; long contexts are where a drafter trained short loses acceptance."""
    buckets: dict[str, list[int]] = {}
    for i, n in enumerate(prompt_lengths):
        buckets.setdefault(bucket_name(n), []).append(i)
    order = sorted(buckets, key=lambda b: int(b.lstrip(">=").split("-")[0]))
    return {
        b: {"prompts": len(buckets[b])}
        | {m: _json_number(mean_tau([results[m][i].tau for i in buckets[b]])) for m in SPECULATIVE}
        for b in order
    }


def build_report(
    settings: dict,
    results: dict[str, list[Generation]],
    block_size: int,
    prompt_lengths: list[int] | None = None,
) -> dict:
    """REPORT.json: settings, the tau definition, per-method statistics (one key per method) and
    speedups over plain decoding.

    At T = 0 it also counts the prompts whose speculative output is token-for-token the autoregressive
    one: all of them, unless the target's batched and one-token forwards round differently (bf16)."""
    methods = {name: method_summary(gens, block_size) for name, gens in results.items()}
    tpot = {name: _tpot(gens) for name, gens in results.items()}  # unrounded, for the ratios
    base = tpot["autoregressive"]
    report = {
        "settings": settings,
        "tau_definition": TAU_DEFINITION,
        **methods,
        "speedup": {m: _json_number(base / tpot[m]) if base and tpot[m] else None for m in SPECULATIVE},
        "tau_ratio_dflash_over_ngram": tau_ratio(
            [g.tau for g in results["dflash"]], [g.tau for g in results["ngram"]]
        ),
    }
    if prompt_lengths is not None:
        report["tau_by_prompt_length"] = tau_by_prompt_length(results, prompt_lengths)
    if settings.get("temperature", 0.0) <= 0:
        plain = [g.tokens for g in results["autoregressive"]]
        report["identical_to_autoregressive"] = {
            m: sum(g.tokens == p for g, p in zip(results[m], plain, strict=True)) for m in SPECULATIVE
        } | {"of": len(plain)}
    return report


def write_plot(report: dict, path: Path) -> Path:
    """Acceptance-length histogram and per-position acceptance of DFlash and n-gram, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist_ax, pos_ax) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.4
    for i, m in enumerate(SPECULATIVE):
        stats = report[m]
        counts = stats["accept_length_histogram"]
        total = max(1, sum(counts.values()))
        xs = [int(k) + (i - 0.5) * width for k in counts]
        hist_ax.bar(
            xs, [c / total for c in counts.values()], width, label=f"{m} (tau {_fmt(stats['tau'], '.2f')})"
        )
        rates = stats["acceptance_by_position"]
        pos_ax.plot(range(1, len(rates) + 1), [math.nan if r is None else r for r in rates], "o-", label=m)
    hist_ax.set(xlabel="acceptance length (tokens per cycle)", ylabel="fraction of cycles")
    pos_ax.set(xlabel="draft position k", ylabel="P(draft k accepted)", ylim=(0, 1.02))
    hist_ax.legend()
    pos_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(report: dict, path: str | Path) -> tuple[Path, Path]:
    """REPORT.json and the plot next to it (same name, .png)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path, write_plot(report, path.with_suffix(".png"))


def _fmt(x: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "-" if x is None else format(x * scale, spec) + unit


def _tau_cell(stats: dict) -> str:
    se = stats.get("tau_stderr")
    return _fmt(stats["tau"], ".2f") + ("" if se is None else f" ± {se:.2f}")


def print_table(report: dict, console: Console | None = None) -> None:
    """The report's headline numbers as a rich table."""
    table = Table(title="speculative decoding vs plain autoregressive decoding")
    for col in ("method", "tau", "tokens/s", "ms/token", "speedup", "output tokens"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name in METHODS:
        stats = report[name]
        table.add_row(
            name,
            _tau_cell(stats) if name in SPECULATIVE else "1",
            _fmt(stats["tokens_per_s"], ".1f"),
            _fmt(stats["time_per_output_token_s"], ".2f", scale=1e3),
            _fmt(report["speedup"].get(name, 1.0), ".2f", unit="x"),
            str(stats["output_tokens"]),
        )
    console = console or Console()
    console.print(table)
    r = report["tau_ratio_dflash_over_ngram"]
    if r["ratio"] is not None:
        lo, hi = r["ci95"]
        console.print(
            f"tau DFlash / n-gram: {r['ratio']:.2f} (95% interval {lo:.2f}-{hi:.2f}, {r['samples']} prompts)"
        )
    rates = report["dflash"]["acceptance_by_position"]
    console.print("DFlash acceptance by draft position: " + " ".join(_fmt(r, ".2f") for r in rates))
    by_length = report.get("tau_by_prompt_length") or {}
    if len(by_length) > 1:
        parts = [f"{b} tokens: {_fmt(v['dflash'], '.2f')} ({v['prompts']})" for b, v in by_length.items()]
        console.print("DFlash tau by prompt length: " + ", ".join(parts))
    same = report.get("identical_to_autoregressive")
    if same:
        console.print(
            f"greedy outputs identical to autoregressive: dflash {same['dflash']}/{same['of']}, "
            f"ngram {same['ngram']}/{same['of']}"
        )


def compare_methods(
    target: str | Path,
    drafter: str | Path,
    conversations: list[list[dict]],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    block_size: int | None = None,
    thinking: bool = False,
    device: str | None = None,
    seed: int = 0,
    progress=None,
    cuda_graphs: bool = False,
    attention: str = "auto",
    methods: Sequence[str] = METHODS,
    draft_sampling: str = "auto",
    stop_strings: Sequence[str] = (),
) -> dict:
    """Load the target (HF directory or hub id) and the drafter checkpoint, decode every conversation with
    plain decoding, DFlash and prompt lookup, and return the report (`build_report`). cuda_graphs: see
    `run_methods`; attention: the target's (`flashdraft.model.target.load_target`). `methods`: fewer of
    them give a report of their statistics alone (no speedup or ratio), e.g. one method's tau where the
    others were measured elsewhere. draft_sampling: DFlash's drafts, as in `run_methods`. stop_strings:
    each decoding ends once its new text holds one (`StopText`), e.g. HumanEval's for completions."""

    from flashdraft.model.checkpoint import load_drafter, read_config
    from flashdraft.model.target import load_target, target_config

    device = default_device(device)
    # the shapes from the configs, before any weight loads (a GGUF's config is a parse of the whole file:
    # decoding_target checks it after the load)
    if not str(target).endswith(".gguf"):
        check_drafter_fits(target_config(target), read_config(Path(drafter)))
    model, tokenizer = load_target(target, device, attention=attention)
    draft = load_drafter(drafter, device, dtype=model.dtype).eval()
    spec_target = decoding_target(model, draft)
    block = block_size or draft.block_size
    draft_sampling = resolve_draft_sampling(draft_sampling, draft, temperature)
    ids = [encode_prompt(tokenizer, c, thinking) for c in conversations]
    stops = stop_token_ids(model, tokenizer)
    stop_text = StopText(tokenizer, stop_strings) if stop_strings else None
    results = run_methods(
        spec_target, draft, ids, max_new_tokens, block, temperature, stops, seed, progress, cuda_graphs,
        methods, draft_sampling, stop_text,
    )  # fmt: skip
    settings = {
        "target": str(target),
        "drafter": str(drafter),
        "num_prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "draft_sampling": draft_sampling,
        "block_size": block,
        "thinking": thinking,
        "device": str(device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "seed": seed,
        "cuda_graphs": cuda_graphs,
        "target_attention": model.config.get_text_config()._attn_implementation,
        "stop_strings": list(stop_strings),
    }
    if set(methods) != set(METHODS):
        stats = {m: method_summary(gens, block) for m, gens in results.items()}
        return {"settings": settings, "tau_definition": TAU_DEFINITION, **stats}
    return build_report(settings, results, block, [len(i) for i in ids])
