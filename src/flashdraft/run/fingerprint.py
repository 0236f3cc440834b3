"""Environment fingerprint: what a run ran on, so `flashdraft doctor` can say what changed since it worked.

A run that worked yesterday and fails today usually fails because something underneath it moved: a
torch or driver upgrade, an edit to the drafter's code, a package pulled in by another tool, a cold
compile cache. `fingerprint()` records all of these as one JSON-able dict (saved as env.json in the
run and in every checkpoint) and `diff_fingerprints()` lists the differences, most likely culprit
first. Written by hand because no library records interpreter, accelerator stack, installed packages,
the project's git state and a hash of one package's source together; each piece comes from its own
authority (importlib.metadata, torch, nvidia-smi, git).

Nothing secret is recorded: of the environment, only the variables of an allow-list (`RECORDED_ENV`:
what changes how torch, CUDA, NCCL and Triton run), never one chosen by a pattern of names, which lets
a `TORCH_STORE_PWD` or a `TRITON_REMOTE_CACHE_CREDS` through; the project's uncommitted changes only as
a hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

import flashdraft
import flashdraft.model

ENV_FILE = "env.json"  # RUN/env.json and RUN/checkpoints/step_NNNNNN/env.json
# the environment variables recorded (an allow-list: a variable not named here is never written)
RECORDED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING",
        "NCCL_DEBUG", "NCCL_ALGO", "NCCL_PROTO", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_IB_DISABLE",
        "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_SOCKET_IFNAME", "NCCL_NET_GDR_LEVEL",
        "NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NVSHMEM_DISABLE_NVLS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST", "TORCH_CUDA_ARCH_LIST", "TORCH_LOGS", "TORCH_COMPILE_DEBUG",
        "TORCHDYNAMO_DISABLE", "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
        "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_COMPILE_THREADS",
        "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING", "TRITON_CACHE_DIR", "TRITON_INTERPRET",
        "TRITON_DEBUG", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM",
        "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
    }
)  # fmt: skip

# Packages compared under "libraries" as imported, packages of the accelerator stack (rank 1) and
# packages the training code calls directly (rank 3).
LIBRARY_PACKAGES = frozenset({"torch", "triton", "transformers"})
RUNTIME_PACKAGES = re.compile(r"pytorch-triton|nvidia-.*")
KEY_PACKAGES = frozenset(
    {
        "tokenizers",
        "safetensors",
        "numpy",
        "datasets",
        "pyarrow",
        "accelerate",
        "liger-kernel",
        "cut-cross-entropy",
    }
)

GROUPS = {
    1: "torch, CUDA, GPU",
    2: "project code",
    3: "key libraries",
    4: "other packages and system",
    5: "compile cache",
}


@dataclass(frozen=True)
class Change:
    """One difference between two fingerprints; rank 1 is the most likely to break a run."""

    group: str
    rank: int
    key: str
    old: Any
    new: Any


def fingerprint(
    project_root: Path | None = None, compile_cache_dir: Path | None = None, extra: dict | None = None
) -> dict:
    """This environment as a JSON-able dict; `extra` (e.g. {"throughput": {...}}) is merged in at the top."""
    return {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
        },
        "libraries": library_versions(),
        "gpu": gpu_info(),
        "packages": installed_packages(),
        "project": git_state(project_root or Path(flashdraft.__file__).parent),
        "model_code": code_hash(Path(flashdraft.model.__file__).parent),
        "compile_cache": compile_cache_info(compile_cache_dir or default_compile_cache_dir()),
        "env": safe_environment(),
        **(extra or {}),
    }


def library_versions() -> dict:
    """The versions that run: torch as imported, its CUDA and cuDNN, triton when importable, transformers."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": triton_version,
        "transformers": _distribution_version("transformers"),
    }


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_info() -> dict:
    """Visible GPUs (after CUDA_VISIBLE_DEVICES) and the driver; count 0 on a CPU-only machine."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "count": count,
        "models": [torch.cuda.get_device_name(i) for i in range(count)],
        "capability": [".".join(map(str, torch.cuda.get_device_capability(i))) for i in range(count)],
        "driver": nvidia_driver_version(),
    }


def nvidia_driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def installed_packages() -> dict[str, str]:
    """Every installed distribution by normalised name (PEP 503); the first on sys.path wins, as in import."""
    packages: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            packages.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)
    return dict(sorted(packages.items()))


def git_state(path: Path) -> dict:
    """Commit of the repository holding `path` and a hash of its uncommitted changes (diff + untracked)."""
    root = _git(path, "rev-parse", "--show-toplevel")
    if root is None:
        return {"git": False, "root": str(path), "commit": None, "uncommitted": None}
    root_path = Path(root.decode().strip())
    commit = _git(root_path, "rev-parse", "--verify", "--quiet", "HEAD")
    return {
        "git": True,
        "root": str(root_path),
        "commit": commit.decode().strip() if commit else None,
        "uncommitted": _uncommitted_hash(root_path, has_head=commit is not None),
    }


def _git(cwd: Path, *args: str) -> bytes | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _uncommitted_hash(root: Path, has_head: bool) -> str | None:
    """None when the tree is clean, so a clean checkout of the same commit compares equal."""
    diff = _git(root, "diff", "HEAD", "--binary") if has_head else _git(root, "diff", "--cached", "--binary")
    untracked = (_git(root, "ls-files", "--others", "--exclude-standard", "-z") or b"").split(b"\0")
    names = sorted(n.decode() for n in untracked if n)
    if not diff and not names:
        return None
    h = hashlib.sha256(diff or b"")
    for name in names:
        h.update(b"\0" + name.encode() + b"\0")
        h.update(_untracked_digest(root / name).encode())
    return h.hexdigest()


def _untracked_digest(path: Path) -> str:
    """A link by its target; a file that vanished since git listed it (an editor's temp file) by that fact."""
    try:
        return os.readlink(path) if path.is_symlink() else _file_sha256(path)
    except OSError:
        return "unreadable"


def code_hash(directory: Path) -> dict:
    """sha256 of each *.py file in `directory` and one hash over all of them (names and bytes only)."""
    files = {p.name: _file_sha256(p) for p in sorted(directory.glob("*.py"))}
    combined = hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in files.items()).encode())
    return {"hash": combined.hexdigest(), "files": files}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_compile_cache_dir() -> Path:
    """The inductor cache torch uses here (TORCHINDUCTOR_CACHE_DIR when set); looked up, never created."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).absolute()


def compile_cache_info(path: Path) -> dict:
    return {"dir": str(path), "present": path.is_dir(), "size_bytes": _tree_size(path)}


def _tree_size(path: Path) -> int:
    """Bytes under `path`; files that vanish while walking (another process pruning) are skipped."""
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


def safe_environment() -> dict[str, str]:
    """The variables of RECORDED_ENV that are set, and no other."""
    return {k: v for k, v in sorted(os.environ.items()) if k in RECORDED_ENV}


def diff_fingerprints(old: dict, new: dict) -> list[Change]:
    """Differences in the environment, most likely to break a run first (rank 1..5, then key)."""
    before, after = _flatten(old), _flatten(new)
    changes = []
    for key in sorted(before.keys() | after.keys()):
        rank = rank_of(key)
        if rank is not None and before.get(key) != after.get(key):
            changes.append(Change(GROUPS[rank], rank, key, before.get(key), after.get(key)))
    return sorted(changes, key=lambda c: (c.rank, c.key))


def rank_of(key: str) -> int | None:
    """How likely a change of `key` breaks a run; None for what is not environment (throughput, time)."""
    section, _, rest = key.partition(".")
    if section == "packages":
        return _package_rank(rest)
    if section == "libraries":
        return 3 if rest == "transformers" else 1
    return {
        "gpu": 1,
        "python": 1 if rest == "version" else 4,
        "model_code": 2,
        "project": 2 if rest in ("commit", "uncommitted") else None,
        "platform": 4,
        "env": 4,
        "compile_cache": 5,
    }.get(section)


def _package_rank(name: str) -> int | None:
    if name in LIBRARY_PACKAGES:
        return None
    if RUNTIME_PACKAGES.fullmatch(name):
        return 1
    return 3 if name in KEY_PACKAGES else 4


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat
