"""Data parallelism for the drafter: DDP replicas, or FSDP2 shards for a drafter too big to replicate.

`parallelize` wraps the drafter for its drafter group; the rest of the trainer calls the helpers
here, which treat both alike: skipping the gradient sync of a micro-step, the global gradient norm,
and the state in full.

FSDP2 (`fully_shard`, each decoder layer and then the root) shards parameters, gradients and AdamW
state over the drafter ranks; parameters stay fp32 (no MixedPrecisionPolicy), so the trainer's
autocast computes in bf16 on fp32 master weights exactly as with DDP. Checkpoints hold full tensors
in the layout of a plain module's and optimizer's state_dict(), so a sharded run and a replicated
one resume each other. The gathering is written here rather than taken from
torch.distributed.checkpoint.state_dict: its CPU-offloading and broadcast modes keep the state on
global rank 0, which is a target rank in a split layout, and its optimizer layout is keyed by
parameter names instead of the optimizer's own indices.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from flashdraft.distributed.topology import Topology


def parallelize(drafter: nn.Module, topo: Topology, fsdp: bool = False) -> nn.Module:
    """The module a drafter rank calls: the drafter itself (one drafter rank, or sharded in place by
    FSDP2) or its DDP wrapper. Build the optimizer afterwards: sharding replaces the parameters."""
    if topo.num_drafters == 1 or not topo.is_drafter:
        return drafter
    if not fsdp:
        # no buffers broadcast before each forward: the drafter's are RoPE's frequencies, computed alike
        # on every rank, and the bf16 copies of bf16_weights, refreshed on each rank from the same weights
        return DistributedDataParallel(drafter, process_group=topo.drafter_group, broadcast_buffers=False)
    if topo.device.type == "cuda" and topo.backend == "gloo":
        raise ValueError(
            "--fsdp on GPUs needs NCCL: gloo cannot all-gather CUDA tensors (use --backend auto, one GPU "
            "per rank, or DDP to share one GPU between ranks)"
        )
    mesh = DeviceMesh.from_group(topo.drafter_group, topo.device.type)
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(drafter, mesh=mesh)
    return drafter


def is_sharded(drafter: nn.Module) -> bool:
    return isinstance(drafter, FSDPModule)


def sharding_line(drafter: nn.Module) -> str:
    """What --fsdp did on this rank, for the start-up log."""
    if not is_sharded(drafter):
        return "fsdp: one drafter rank, nothing to shard; the drafter trains unsharded"
    total = sum(p.numel() for p in drafter.parameters())
    held = sum(p.to_local().numel() for p in drafter.parameters())
    return f"fsdp: this rank holds {held:,} of the drafter's {total:,} parameters"


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Within: backward accumulates gradients locally, without the all-reduce (DDP) or
    reduce-scatter (FSDP2), unless `enabled` (the last micro-step of a step)."""
    if enabled or not isinstance(model, DistributedDataParallel | FSDPModule):
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def clip_divisor(parameters, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm of all gradients, sharded ones too, as a plain tensor the same on every rank; the
    divisor that clips them to `max_norm`, max(1, (norm + 1e-6) / max_norm)). The gradients are left as
    they are: fused AdamW divides by the divisor inside its own kernel (its `grad_scale`), which saves
    clip_grad_norm_'s separate pass over them (the qwen3-8b optimizer phase 12.4 -> 11.7 ms on the H200,
    docs/results.md); the update is clip_grad_norm_'s to fp32 rounding."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return norm, ((norm + 1e-6) / max_norm).clamp(min=1.0)


def full_state(drafter: nn.Module, optimizer: torch.optim.Optimizer, keep: bool) -> tuple[dict, dict]:
    """The drafter's and optimizer's state_dict() with full CPU tensors where `keep`, empty dicts
    elsewhere. Sharded: gathered one tensor at a time, a collective every drafter rank must enter."""
    if not is_sharded(drafter):
        return (drafter.state_dict(), optimizer.state_dict()) if keep else ({}, {})
    weights = {k: _gathered(v, keep) for k, v in drafter.state_dict().items()}
    optim = optimizer.state_dict()
    state = {i: {k: _gathered(v, keep) for k, v in s.items()} for i, s in optim["state"].items()}
    return (weights, {**optim, "state": state}) if keep else ({}, {})


def load_full_state(drafter: nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optim: dict) -> None:
    """Load full state (every rank holds all of it) into the drafter and optimizer, each rank keeping
    its own shard of a sharded drafter."""
    if is_sharded(drafter):
        params = dict(drafter.named_parameters())
        weights = {k: _shard_like(v, params[k]) for k, v in weights.items()}
        by_index = [p for group in optimizer.param_groups for p in group["params"]]
        state = {i: {k: _shard_like(v, by_index[i]) for k, v in s.items()} for i, s in optim["state"].items()}
        optim = {**optim, "state": state}
    drafter.load_state_dict(weights)
    optimizer.load_state_dict(optim)


def _gathered(value, keep: bool):
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.cpu() if keep and isinstance(value, torch.Tensor) else value


def _shard_like(value, param):
    """This rank's shard of full tensor `value`, sharded as `param`; scalars (AdamW's step) as they are."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
