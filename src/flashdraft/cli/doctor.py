"""`flashdraft doctor`: what changed since a run last worked, or whether this environment can train.

With RUN, the fingerprint recorded in RUN's newest complete checkpoint (RUN/env.json when there is
none) is diffed against this environment and printed most likely culprit first, with the throughput
the run reached then. Without RUN, the checks a training start depends on are run: a visible GPU,
flex_attention compiling and running under torch.compile, a writable compile cache.
"""

from __future__ import annotations

import itertools
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def doctor_cmd(
    run: Path | None = typer.Argument(
        None, help="run directory to compare with; omit to check this environment"
    ),
) -> None:
    """What differs now from RUN's last good checkpoint; with no RUN, whether this environment can train."""
    if run is None:
        checks = health_checks()
        _print_checks(checks)
        if not all(c.ok for c in checks):
            raise typer.Exit(1)
        return
    from flashdraft.run.fingerprint import diff_fingerprints, fingerprint

    try:
        source, recorded = recorded_fingerprint(run)
    except (FileNotFoundError, json.JSONDecodeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    _print_changes(source, recorded, diff_fingerprints(recorded, fingerprint()))


def recorded_fingerprint(run: Path) -> tuple[Path, dict]:
    """env.json of RUN's newest complete checkpoint (checkpoints/LATEST), else RUN/env.json."""
    from flashdraft.model.checkpoint import latest_checkpoint
    from flashdraft.run.fingerprint import ENV_FILE

    ckpt = latest_checkpoint(run / "checkpoints")
    candidates = ([ckpt / ENV_FILE] if ckpt else []) + [run / ENV_FILE]
    for path in candidates:
        if path.is_file():
            try:
                return path, json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise json.JSONDecodeError(f"{path}: not valid JSON: {e.msg}", e.doc, e.pos) from None
    raise FileNotFoundError(f"no fingerprint in {run}: looked for {', '.join(map(str, candidates))}")


def _print_changes(source: Path, recorded: dict, changes: list) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"recorded {recorded.get('created', '(time unknown)')} in {source}", soft_wrap=True)
    if changes:
        table = Table(title="what changed since (most likely to break a run first)")
        for column in ("rank", "group", "key", "then", "now"):
            table.add_column(column, no_wrap=column == "key")  # a key must stay greppable
        for (rank, group), rows in itertools.groupby(changes, key=lambda c: (c.rank, c.group)):
            table.add_section()
            for i, c in enumerate(rows):
                table.add_row(
                    str(rank) if i == 0 else "", group if i == 0 else "", c.key, _show(c.old), _show(c.new)
                )
        console.print(table)
    else:
        console.print("no differences in the environment")
    console.print(f"throughput then: {_show_throughput(recorded.get('throughput'))}")


def _show(value: Any) -> str:
    if value is None:
        return "absent"
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{40,64}", value):
        return value[:12]  # a hash or commit: the prefix identifies it
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def _show_throughput(throughput: dict | None) -> str:
    if not throughput:
        return "not recorded"
    return "; ".join(f"{k} {_number(v)}" for k, v in throughput.items())


def _number(v: Any) -> str:
    """Counts and rates whole (8,161 tok/s), a figure under 100 with three significant digits (a loss)."""
    if isinstance(v, float) and abs(v) < 100:
        return f"{v:.3g}"
    return f"{v:,.0f}" if isinstance(v, int | float) else str(v)


def health_checks() -> list[Check]:
    import torch

    from flashdraft.model.target import default_device
    from flashdraft.train.compile import cache_dir_for

    device = default_device()
    cache = cache_dir_for(None, torch.device(device))  # the one training compiles into
    return [check_gpu(), check_cache_writable(cache), check_flex_attention(device)]


def check_gpu() -> Check:
    """Informational: a CPU-only machine is healthy, it just trains slowly."""
    from flashdraft.run.fingerprint import gpu_info

    gpu = gpu_info()
    if not gpu["count"]:
        return Check("GPU", True, "CPU only")
    models = ", ".join(f"{n} x {m}" for m, n in _counted(gpu["models"]))
    return Check("GPU", True, f"{models} (driver {gpu['driver'] or 'unknown'})")


def _counted(items: list[str]) -> list[tuple[str, int]]:
    return [(item, items.count(item)) for item in dict.fromkeys(items)]


def check_cache_writable(path: Path) -> Check:
    from flashdraft.run.fingerprint import compile_cache_info

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        return Check("compile cache", False, f"{path} is not writable: {e.strerror or e}")
    size = compile_cache_info(path)["size_bytes"]
    return Check("compile cache", True, f"{path} writable, {size / 2**20:,.1f} MiB cached")


def check_flex_attention(device: str) -> Check:
    """torch.compile(flex_attention) on a tiny input, compared with SDPA: the path training depends on."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(1, 2, 128, 16, device=device) for _ in range(3))
    start = time.perf_counter()
    try:
        out = torch.compile(flex_attention, dynamic=False)(q, k, v)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # whatever the compiler raises is the finding
        first_line = (str(e).strip().splitlines() or [""])[0]
        return Check(
            "flex_attention", False, f"torch.compile failed on {device}: {type(e).__name__}: {first_line}"
        )
    seconds = time.perf_counter() - start
    err = (out - F.scaled_dot_product_attention(q, k, v)).abs().max().item()
    if err > 1e-2:
        return Check("flex_attention", False, f"compiled on {device} but differs from SDPA by {err:.2e}")
    return Check("flex_attention", True, f"compiled and ran on {device} in {seconds:.1f} s")


def _print_checks(checks: list[Check]) -> None:
    import torch
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"flashdraft doctor: torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    for c in checks:
        table.add_row(c.name, "ok" if c.ok else "FAIL", c.detail)
    Console().print(table)
