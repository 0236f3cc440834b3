"""The frozen target's decoder-layer linears in FP8 (`target_fp8`): e4m3 weights with one scale per
output row, activations quantised per token as they come, products through `torch._scaled_mm`
(cuBLASLt's FP8 GEMM on an H100/H200, whose FP8 rate is twice its bf16 rate; computed exactly on the
CPU, so the tests run there). Only the target: it is frozen, so its weights are quantised once, and
nothing is differentiated through it.

Hand-written over torch's own op because the libraries that do this refuse the CPU: torchao's float8
inference asserts CUDA of compute capability >= 8.9 (or MI300, XPU), and transformers' fine-grained FP8
is a block-wise triton kernel. What FP8 features cost in served tau is measured in docs/results.md
and docs/recipe.md.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (e4m3 [m, k], float32 scale [m, 1]) with x ~ e4m3 * scale, each row's largest
    magnitude mapped to e4m3's largest."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).to(E4M3), scale


class Fp8Linear(nn.Module):
    """A frozen nn.Linear whose weight is held in e4m3 with a scale per output row (in_features and
    out_features multiples of 16, as cuBLASLt's FP8 GEMM requires)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = _quantize_rows(linear.weight.detach())
        self.register_buffer("weight", weight)  # [out, in]: its transpose is the column-major operand
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        q, scale = _quantize_rows(rows)
        out = torch._scaled_mm(
            q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype
        )
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise"


def fp8_eligible(linear: nn.Module) -> bool:
    return isinstance(linear, nn.Linear) and linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def check_fp8_device(device: torch.device) -> None:
    """FP8 GEMMs run on the CPU and on CUDA of compute capability 8.9 or more (Ada, Hopper, Blackwell)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"target_fp8: {name} has no FP8 matrix units (compute capability 8.9 or more needed)"
        )


def to_fp8_(layers: nn.ModuleList) -> tuple[int, int]:
    """Replace, in place, every nn.Linear inside `layers` (the target's decoder layers) by an Fp8Linear
    where its shape allows; (replaced, left in their dtype). Routed experts stay as they are: stored as
    fused parameters (transformers' MoE models) or as nn.Linear under an `experts` module, so the FLOP
    accounting (train/flops.py) knows what runs in FP8."""
    replaced = kept = 0
    for layer in layers:
        for name, child in list(layer.named_modules()):
            if not isinstance(child, nn.Linear) or "experts" in name.split("."):
                continue
            if not fp8_eligible(child):
                kept += 1
                continue
            parent_name, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, attr, Fp8Linear(child))
            replaced += 1
    return replaced, kept
