"""The one owner of the world: ranks, roles, process groups and devices.

Layouts (flashdraft.distributed.layout): `colocated` (every rank runs the target and a drafter
replica) or `split:T:D` (T target ranks send features to D drafter ranks). With target parallelism
`fsdp:N` the target ranks form groups of N that each share one sharded target (`target_group`).

One process per GPU, always (launched by torchrun or `flashdraft train --nproc N`), and each
process sees its GPU as cuda:0, so compile-cache keys are identical on every rank. CPU runs use gloo.
Model code never imports torch.distributed; it asks this object.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from flashdraft.distributed.layout import Layout, TargetParallel


@dataclass
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    layout: Layout = field(default_factory=lambda: Layout().on(1))
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    drafter_group: object | None = None  # process group of drafter ranks (gradient all-reduce)
    exchange_group: object | None = None  # split layouts: the feature messages' own group
    target_parallel: TargetParallel = field(default_factory=TargetParallel)
    target_group: object | None = None  # a sharded target: this target rank's group
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
        return not self.layout.is_split or self.rank < self.layout.targets

    @property
    def is_drafter(self) -> bool:
        return not self.layout.is_split or self.rank >= self.layout.targets

    @property
    def drafter_rank(self) -> int:
        """Index among drafter ranks: which share of the data this rank trains on."""
        return self.rank - self.layout.targets if self.layout.is_split else self.rank

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
        base = self.layout.targets if self.layout.is_split else 0
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

    def drafter_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the drafter ranks (the step's loss weights, its statistics)."""
        if self.num_drafters > 1:
            dist.all_reduce(tensor, group=self.drafter_group)
        return tensor

    def drafter_barrier(self) -> None:
        """Wait for every drafter rank (a checkpoint is complete on all before any goes on)."""
        if self.num_drafters > 1:
            dist.barrier(group=self.drafter_group)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        """Destroy the process groups, after releasing what holds them. DTensor's sharding-propagation
        caches keep a sharded target's device mesh, and through it the target group, alive after the
        model is gone: a gloo group that outlives `destroy_process_group` keeps its threads running
        until the interpreter's teardown, where they are destroyed unjoined and abort the process
        now and then (about 1 run in 25 of tests/test_sharded_target.py's features script)."""
        if not (self.distributed and dist.is_initialized()):
            return
        if self.target_group is not None:
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
        self.drafter_group = self.exchange_group = self.target_group = None
        gc.collect()
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


def init_topology(
    layout: str | Layout = "colocated",
    device: str | None = None,
    backend: str = "auto",
    target_parallel: str | TargetParallel = "none",
) -> Topology:
    """Read the torchrun environment (or none: a single process) and build the process groups.

    backend: auto (NCCL on GPU, gloo on CPU), or gloo to put several ranks on one GPU (NCCL
    refuses two ranks on one device), which is how the layouts are exercised on a one-GPU machine.
    target_parallel: `fsdp:N` shards the target over groups of N target ranks (`target_group`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    lay = Layout.parse(layout).on(world)
    tp = TargetParallel.parse(target_parallel)
    groups = tp.groups(lay) if tp.sharded else []  # refused before any process group exists
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    topo = Topology(rank, world, local, lay, dev, target_parallel=tp)
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: choose auto, gloo or nccl")
    if world > 1:
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        topo.backend = backend
        dist.init_process_group(
            backend, timeout=timedelta(minutes=30), device_id=dev if backend == "nccl" else None
        )
        drafters = list(range(lay.targets, world)) if lay.is_split else list(range(world))
        topo.drafter_group = dist.new_group(drafters) if len(drafters) < world else dist.group.WORLD
        if lay.is_split:  # feature messages never queue behind (or between) other collectives
            topo.exchange_group = dist.new_group(list(range(world)))
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                topo.target_group = group
    return topo
