"""A frozen target too large for one GPU, sharded over a target group with FSDP2 (`--target-parallel fsdp:N`).

Each decoder layer is its own FSDP2 unit (`fully_shard`, resharded after its forward): a rank holds 1/N
of every layer's weights and all-gathers one layer at a time while it runs. The embedding, the lm_head,
the final norm and the rotary tables stay whole on every rank: the drafter reads the embedding and
lm_head directly, and they are a small part of a large target (4.2 of Llama-3.1-70B's 141 GB).

Why FSDP2 rather than tensor parallelism: every target rank keeps computing features for its own
micro-batches, so the layouts, the feature exchange and the data split stay as they are; a layer's
weights are gathered while the one before it runs, where tensor parallelism would all-reduce
activations twice a layer on the critical path and needs a `tp_plan` the model class may not have;
and sharding the parameter tensors works for every family the loader reads, MoE experts included (a
fused expert tensor is split along its first axis, the experts).

Loading never holds the target whole: the model is built on the meta device (only the layers up to the
last tap, as `load_target(layers=...)`), sharded, given empty storage on this rank's device, and filled
by torch.distributed.checkpoint's `HuggingFaceStorageReader`, which reads from the safetensors files
only the rows of each weight that this rank keeps. Buffers that no checkpoint holds (rotary frequency
tables, Gemma's embedding scale) are computed by transformers on a copy of the model with no decoder
layers. Weights are read under the model's own names, or, for a fused expert tensor, under the
per-expert names that MoE checkpoints use (each rank reads only its experts); a checkpoint that needs
another conversion (GGUF, renamed weights) is refused with the keys that do not match.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from flashdraft.distributed.topology import Topology
from flashdraft.model.target import (
    decoder_layers,
    first_layers_config,
    left_out,
    load_tokenizer,
    named_keys,
    target_config,
)


def load_sharded_target(
    path: str | Path,
    topo: Topology,
    dtype: torch.dtype | None = None,
    attention: str = "auto",
    layers: int | None = None,
) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer) as `load_target` gives them, the decoder layers sharded over `topo.target_group`
    (every rank of the group must call this); the model is frozen and in eval mode."""
    import torch.distributed.checkpoint as dcp

    directory = Path(str(path))
    if directory.suffix == ".gguf" or not any(directory.glob("*.safetensors")):
        raise ValueError(
            f"{path}: a sharded target is read from a local directory of safetensors files (a GGUF file or "
            "a hub id is not: download or convert it first)"
        )
    if topo.target_group is None:
        raise ValueError("a sharded target needs a target group: run with --target-parallel fsdp:N")
    if topo.device.type == "cuda" and topo.backend == "gloo":
        raise ValueError("a sharded target on GPUs needs NCCL: gloo cannot all-gather CUDA tensors")
    dtype = dtype or (torch.bfloat16 if topo.device.type == "cuda" else torch.float32)
    whole = target_config(path)
    depth = whole.get_text_config().num_hidden_layers
    if layers is not None and not 0 <= layers <= depth:
        raise ValueError(f"{path}: layers={layers}, the target has {depth}")
    config = first_layers_config(whole, layers) if layers is not None and layers < depth else whole
    kwargs = {} if attention == "auto" else {"attn_implementation": attention}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    mesh = DeviceMesh.from_group(topo.target_group, topo.device.type)
    for layer in decoder_layers(model)[2]:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    model.to_empty(device=topo.device)
    _fill_buffers(model, whole, dtype)
    reader = dcp.HuggingFaceStorageReader(str(directory))
    state = _state_to_load(model, reader.read_metadata().state_dict_metadata, path, layers is not None)
    dcp.load(state, storage_reader=reader, process_group=topo.target_group)
    model.requires_grad_(False).eval()
    return model, load_tokenizer(path)


def _fill_buffers(model: PreTrainedModel, whole_config, dtype: torch.dtype) -> None:
    """The buffers no checkpoint holds, as transformers computes them, from a copy with no decoder layers
    (its list of layer kinds kept whole: Gemma 3 builds one rotary table per kind it lists)."""
    config = copy.deepcopy(whole_config)
    config.get_text_config().num_hidden_layers = 0
    shell = AutoModelForCausalLM.from_config(config, dtype=dtype)
    computed = dict(shell.named_buffers())
    for name, buffer in model.named_non_persistent_buffers():
        if name not in computed:
            raise ValueError(f"{type(model).__name__}: cannot compute buffer {name} for a sharded target")
        buffer.copy_(computed[name])


def _state_to_load(model: PreTrainedModel, stored: dict, path, partial: bool) -> dict:
    """What to fill from the checkpoint: the model's state_dict entries under their own names, and the
    experts of a fused expert tensor under the checkpoint's per-expert names (`_expert_views`). A weight
    the checkpoint lacks (other than one tied to a weight it holds) or holds in another shape is an
    error, one it holds and the model does not use a warning (with `partial`, except those of the
    layers left out)."""
    state = model.state_dict()
    filled = {key: t for key, t in state.items() if key in stored}
    used = set(filled)
    missing = []
    for key, t in state.items():
        views = None if key in stored else _expert_views(key, t, stored)
        if views is not None:
            filled |= views[0]
            used |= views[1]
        elif key not in stored:
            missing.append(key)
    held = {_storage(t) for t in filled.values()}
    missing = [k for k in missing if _storage(state[k]) not in held]
    shapes = [k for k, t in filled.items() if tuple(stored[k].size) != tuple(t.shape)]
    if missing or shapes:
        kinds = (("missing from the checkpoint", missing), ("of another shape", shapes))
        problems = "; ".join(f"{what}: {named_keys(keys)}" for what, keys in kinds if keys)
        raise ValueError(
            f"{path}: the weights do not fit {type(model).__name__} as it names them ({problems}); "
            "a sharded target reads checkpoints in the model's own layout, or with one tensor per "
            "expert where the model fuses them: load it whole"
        )
    attr = decoder_layers(model)[1]
    depth = len(decoder_layers(model)[2])
    unused = [k for k in stored if k not in used and not left_out(k, attr, depth if partial else None)]
    if unused:
        warnings.warn(
            f"{path}: weights {type(model).__name__} does not use: {named_keys(unused)}", stacklevel=3
        )
    return filled


# A fused expert tensor [experts, ...] of the model and the per-expert weights a checkpoint stores it as,
# concatenated along the expert's first axis (transformers fuses them so on load for Qwen3-MoE,
# DeepSeek-V3, Qwen3-Next and the other families of its qwen2_moe conversion).
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _expert_views(key: str, tensor: torch.Tensor, stored: dict) -> tuple[dict, set] | None:
    """For a fused expert tensor stored one tensor per expert: ({checkpoint name: the view of this rank's
    shard it fills}, every checkpoint name the tensor takes, this rank's or not); else None."""
    prefix, dot, name = key.rpartition("experts.")
    parts = EXPERT_PARTS.get(name)
    if not dot or parts is None or f"{prefix}experts.0.{parts[0]}.weight" not in stored:
        return None
    local, first = tensor, 0
    if isinstance(tensor, DTensor):  # sharded along the experts, in torch.chunk's pieces
        local = tensor.to_local()
        first = tensor.device_mesh.get_local_rank() * -(-tensor.shape[0] // tensor.device_mesh.size())
    names = lambda e: [f"{prefix}experts.{e}.{p}.weight" for p in parts]  # noqa: E731
    views = {}
    for i in range(local.shape[0]):
        keys = names(first + i)
        if not all(k in stored for k in keys):
            return None
        sizes = [stored[k].size[0] for k in keys]
        if sum(sizes) != local.shape[1]:
            return None
        views |= dict(zip(keys, torch.split(local[i], sizes), strict=True))
    return views, {k for e in range(tensor.shape[0]) for k in names(e)}


def _storage(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def resident_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the target's parameters: its decoder layers' whole (`layers`), the part of them this rank
    holds (`layers_held`: a 1/N shard when sharded), and the rest, which every rank holds (`rest`)."""
    in_layers = {id(p) for p in decoder_layers(model)[2].parameters()}
    out = {"layers": 0, "layers_held": 0, "rest": 0}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if id(p) in in_layers:
            out["layers"] += p.numel() * p.element_size()
            out["layers_held"] += local.numel() * local.element_size()
        else:
            out["rest"] += local.numel() * local.element_size()
    return out


def sharding_line(model: torch.nn.Module, topo: Topology) -> str:
    """What --target-parallel did on this rank, for the start-up log."""
    b, mib = resident_bytes(model), 2**20
    return (
        f"target parallelism {topo.target_parallel}: this rank holds {b['layers_held'] / mib:,.1f} MiB of "
        f"the loaded layers' {b['layers'] / mib:,.1f} MiB, and the embedding, lm_head and norms whole "
        f"({b['rest'] / mib:,.1f} MiB)"
    )
