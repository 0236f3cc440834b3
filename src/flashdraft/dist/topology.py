"""The one owner of the world: ranks, roles, process groups and devices.

Layouts (design.md "Processes, devices, layouts"):
- `colocated`: every rank holds the frozen target and a drafter replica; gradients all-reduced.
- `split:T:D`: ranks 0..T-1 run the target and send features, ranks T..T+D-1 train the drafter.

One process per GPU, always (launched by torchrun or `flashdraft train --nproc N`), and each
process sees its GPU as cuda:0, so compile-cache keys are identical on every rank. CPU runs use gloo.
Model code never imports torch.distributed; it asks this object.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    kind: str  # "colocated" or "split"
    targets: int = 0
    drafters: int = 0

    @classmethod
    def parse(cls, text: str, world_size: int) -> Layout:
        if text == "colocated":
            return cls("colocated", world_size, world_size)
        m = re.fullmatch(r"split:(\d+):(\d+)", text)
        if not m:
            raise ValueError(f"--layout {text!r}: expected 'colocated' or 'split:T:D' (e.g. split:5:3)")
        t, d = int(m.group(1)), int(m.group(2))
        if t < 1 or d < 1:
            raise ValueError(f"--layout {text}: needs at least one target and one drafter rank")
        if t + d != world_size:
            raise ValueError(f"--layout {text} needs {t + d} processes, but the world has {world_size}")
        return cls("split", t, d)

    def __str__(self) -> str:
        return "colocated" if self.kind == "colocated" else f"split:{self.targets}:{self.drafters}"


@dataclass
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    layout: Layout = field(default_factory=lambda: Layout("colocated", 1, 1))
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    drafter_group: object | None = None  # process group of drafter ranks (gradient all-reduce)
    exchange_group: object | None = None  # split layouts: the feature messages' own group
    backend: str = "gloo"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def wire_device(self) -> torch.device:
        """Where point-to-point messages live: gloo sends only CPU tensors, so ranks sharing one GPU
        over gloo stage features through host memory (slower, for testing layouts on one GPU)."""
        return torch.device("cpu") if self.backend == "gloo" else self.device

    @property
    def is_target(self) -> bool:
        """Computes target features (every rank when colocated)."""
        return self.layout.kind == "colocated" or self.rank < self.layout.targets

    @property
    def is_drafter(self) -> bool:
        return self.layout.kind == "colocated" or self.rank >= self.layout.targets

    @property
    def drafter_rank(self) -> int:
        """Index among drafter ranks: which share of the data this rank trains on."""
        return self.rank if self.layout.kind == "colocated" else self.rank - self.layout.targets

    @property
    def num_drafters(self) -> int:
        return self.layout.drafters

    @property
    def is_main(self) -> bool:
        """The rank that writes logs and checkpoints: the first drafter rank."""
        return self.is_drafter and self.drafter_rank == 0

    def target_rank_for(self, micro_index: int) -> int:
        """Split layout: the target rank that computes global micro-batch `micro_index`."""
        return micro_index % self.layout.targets

    def drafter_rank_for(self, micro_index: int) -> int:
        """Global rank of the drafter that trains on global micro-batch `micro_index`."""
        base = 0 if self.layout.kind == "colocated" else self.layout.targets
        return base + micro_index % self.layout.drafters

    def drafter_max(self, value: float) -> float:
        """The largest `value` over drafter ranks (every drafter rank must call it). Used for the
        wait for features: the other drafter ranks spend that time waiting for the worst-fed one
        in the gradient all-reduce, so the group is idle as long as that rank waits."""
        if self.num_drafters <= 1:
            return value
        device = self.device if self.backend == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.drafter_group)
        return float(t)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def pin_local_gpu() -> None:
    """Make this process see only its own GPU (as cuda:0) before CUDA is initialised."""
    local = os.environ.get("LOCAL_RANK")
    if local is not None and os.environ.get("FLASHDRAFT_SHARE_GPU") == "1":
        return  # every rank on the one visible GPU (testing layouts on a one-GPU machine)
    if local is not None and "FLASHDRAFT_KEEP_VISIBLE_DEVICES" not in os.environ:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else None
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[int(local)] if devices else local
        os.environ["FLASHDRAFT_KEEP_VISIBLE_DEVICES"] = "1"


def init_topology(layout: str = "colocated", device: str | None = None, backend: str = "auto") -> Topology:
    """Read the torchrun environment (or none: a single process) and build the process groups.

    backend: auto (NCCL on GPU, gloo on CPU), or gloo to put several ranks on one GPU (NCCL
    refuses two ranks on one device), which is how the layouts are exercised on a one-GPU machine.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    lay = Layout.parse(layout, world)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    topo = Topology(rank, world, local, lay, dev)
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: choose auto, gloo or nccl")
    if world > 1:
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        topo.backend = backend
        dist.init_process_group(
            backend, timeout=timedelta(minutes=30), device_id=dev if backend == "nccl" else None
        )
        drafters = list(range(world)) if lay.kind == "colocated" else list(range(lay.targets, world))
        topo.drafter_group = dist.new_group(drafters) if len(drafters) < world else dist.group.WORLD
        if lay.kind == "split":  # feature messages never queue behind (or between) other collectives
            topo.exchange_group = dist.new_group(list(range(world)))
    return topo
