"""Compilation that never races and never silently degrades.

- One process per device (the launcher guarantees it), so torch.compile is never entered from
  several threads (pytorch#168042).
- The inductor cache lives in a persistent directory, one per torch / triton / device kind, and the
  portable cache artifacts (`torch.compiler.save_cache_artifacts`) travel with checkpoints, so a
  fresh machine resuming a run starts warm.
- After a warm-up step the `fail_on_recompile` stance is set: a recompile (a changed shape, a
  failed guard) stops the run with a clear message instead of quietly running slower code.
- Inductor's pool of kernel-compiling processes is started before the target loads
  (`start_compile_workers`): inductor starts it at the first compile, and compiles every kernel in the
  main process, one at a time, until the pool answers.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ARTIFACTS = "compile_cache.bin"


class RecompileError(RuntimeError):
    pass


def default_cache_dir(device: torch.device) -> Path:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    kind = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashdraft" / "inductor"
    return root / f"torch-{torch.__version__}-triton-{triton_version}-{kind}"


def _users_cache_dir() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR where it names other than inductor's own default."""
    from torch._inductor.runtime.runtime_utils import default_cache_dir as inductor_default

    user = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return user if user and user != inductor_default() else None


def cache_dir_for(cache_dir: Path | None, device: torch.device) -> Path:
    """Where `use_cache_dir` points inductor, nothing created: `cache_dir`, else a TORCHINDUCTOR_CACHE_DIR
    the user set, else our default."""
    user = _users_cache_dir()
    return Path(cache_dir) if cache_dir else Path(user) if user else default_cache_dir(device)


def use_cache_dir(cache_dir: Path | None, device: torch.device) -> Path:
    """Point inductor at a persistent cache (`cache_dir_for`); the user's own is left as it is. Call
    before anything compiles (inductor reads it at first use)."""
    from torch._inductor import config as inductor_config

    path = cache_dir_for(cache_dir, device)
    if cache_dir is None and _users_cache_dir():
        return path
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    inductor_config.fx_graph_cache = True
    return path


def start_compile_workers() -> None:
    """Start inductor's kernel-compile worker processes now, in the background (they import torch and
    triton, seconds each), so they are ready when the first graph compiles. Inductor does the same at its
    first compile (`maybe_warm_pool`, which honours TORCH_WARM_POOL=0); this calls it earlier. Only
    triton kernels use the pool: with no triton (a CPU build) it does nothing."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def load_artifacts(ckpt_dir: Path | None) -> bool:
    path = Path(ckpt_dir) / ARTIFACTS if ckpt_dir else None
    if path is None or not path.exists():
        return False
    torch.compiler.load_cache_artifacts(path.read_bytes())
    return True


def artifacts_writer():
    """Checkpoint hook: write this process's portable compile cache, if it compiled anything."""

    def write(path: Path) -> None:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            path.write_bytes(saved[0])

    return write


@dataclass
class CompileReport:
    seconds: float
    graphs: int  # graphs dynamo compiled during the warm-up
    cache_hits: int
    cache_misses: int
    artifacts_loaded: bool
    cache_dir: str

    def line(self) -> str:
        loaded = ", portable artifacts loaded" if self.artifacts_loaded else ""
        return (
            f"compile: warm-up {self.seconds:.1f} s, {self.graphs} graphs, inductor cache "
            f"{self.cache_hits} hits / {self.cache_misses} misses ({self.cache_dir}{loaded})"
        )


def cache_counters() -> tuple[int, int, int]:
    """(graphs compiled, inductor cache hits, misses) so far in this process."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    graphs = int(counters["stats"]["unique_graphs"])
    return graphs, int(inductor["fxgraph_cache_hit"]), int(inductor["fxgraph_cache_miss"])


def warm_up(step_fn, cache_dir: Path, artifacts_loaded: bool) -> CompileReport:
    """Run `step_fn` once (it compiles everything a step uses), then forbid recompiles."""
    before = cache_counters()
    t0 = time.perf_counter()
    step_fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    graphs, hits, misses = (a - b for a, b in zip(cache_counters(), before, strict=True))
    torch.compiler.set_stance("fail_on_recompile")
    return CompileReport(seconds, graphs, hits, misses, artifacts_loaded, str(cache_dir))


@contextlib.contextmanager
def recompiles_are_errors():
    """Turn dynamo's recompile failure into a message that says what happened and what to do."""
    try:
        yield
    except Exception as e:
        if "fail_on_recompile" in str(e) or "Detected recompile" in str(e):
            raise RecompileError(
                "a compiled function had to recompile after warm-up (a tensor shape, dtype or guard "
                "changed). flashdraft keeps shapes fixed so steady-state training never recompiles; "
                "this would have silently run slower code. Check that data.seq_len, rows_per_batch "
                f"and num_anchors are constant. torch said: {str(e).splitlines()[0]}"
            ) from e
        raise


def reset_stance() -> None:
    torch.compiler.set_stance("default")
