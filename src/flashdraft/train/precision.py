"""`train.bf16_weights`: the drafter's linears compute from bf16 copies of their fp32 weights, and write
their weight gradients in fp32.

AdamW keeps the drafter's weights in fp32. Under bf16 autocast each linear then casts its weight to bf16
in the forward, the compiled backward casts it again (recomputing is cheaper than keeping it), and the
weight gradient comes out of a bf16 matmul, cast to fp32. That is about 20 bytes of memory traffic a
parameter for every micro-batch, on the step's critical path: some 20 GB for qwen3-8b's drafter of a
billion parameters.

With this setting each linear holds a bf16 copy of its weight (`Bf16Linear`, the same parameters). The
copies are refreshed after the optimizer step, on the optimizer's stream beside the next target forward.
They are also refreshed before any forward that finds a weight changed in place since its copy: its
version counter moved (a resume, an init; fused AdamW moves none). The forward and the input gradient
are the same bf16 matmuls as autocast's. The weight gradient is written in fp32 by the matmul itself
(`torch.mm(..., out_dtype=torch.float32)`), so it is no longer rounded to bf16 on its way to the fp32
gradient. The copies cost 2 bytes a parameter.

Why by hand: torch's autocast and FSDP2's mixed precision both cast the weights every forward.
Transformer Engine fuses the weight gradient into an fp32 buffer, but only for its own modules, and it is
a CUDA build of its own. torch has the pieces (mm's `out_dtype`) and no module that keeps the copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 operands with fp32 products summed in fp32 and written as fp32 (the CPU has no
    kernel for mm's out_dtype; its fp32 matmul of the same bf16 values computes the same)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def in_bf16(device_type: str) -> bool:
    """Whether bf16 autocast is on for `device_type` here: where a Bf16Linear computes from its copy."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16


class _Bf16Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, copy, bias):
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        x = x.to(torch.bfloat16)
        ctx.save_for_backward(x, copy)
        return F.linear(x, copy, None if bias is None else bias.to(torch.bfloat16))

    @staticmethod
    def backward(ctx, dy):
        x, copy = ctx.saved_tensors
        # autocast off: a compiled layer traces its backward under the forward's autocast, which would
        # turn the fp32 matmul of the CPU's _mm_fp32 into a bf16 one
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.to(torch.bfloat16)
            dx = (dy @ copy).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
            rows = dy.reshape(-1, dy.shape[-1])
            dw = _mm_fp32(rows.t(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
            db = rows.sum(0, dtype=torch.float32) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dx, dw, None, db


class Bf16Linear(nn.Module):
    """An nn.Linear's weight and bias (the same parameters, under the same names) and a bf16 copy of
    the weight, which a bf16 autocast forward computes from. Elsewhere (autocast off, or another dtype)
    it is the nn.Linear it was made from."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # not in the state dict: checkpoints hold the fp32 weights alone
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16), persistent=False)
        self.copied = linear.weight._version  # the weight's version the copy holds

    def refresh(self) -> None:
        """Copy the weight into its bf16 copy (on the current stream)."""
        with torch.no_grad():
            self.weight_bf16.copy_(self.weight)
        self.copied = self.weight._version

    def refresh_if_changed(self) -> None:
        """refresh, if an in-place change moved the weight's version counter since the last copy (a
        resume's load_state_dict, an init). Fused AdamW moves none: after it, `refresh`."""
        if self.weight._version != self.copied:
            self.refresh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if in_bf16(x.device.type):
            return _Bf16Linear.apply(x, self.weight, self.weight_bf16, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 copy"


def use_bf16_weights(drafter: nn.Module) -> list[Bf16Linear]:
    """Every nn.Linear of `drafter` becomes a Bf16Linear over the same parameters (before the optimizer
    and the compile see them), and each forward of the drafter first refreshes the copies whose weights
    changed in place (`refresh_if_changed`). Returns the Bf16Linears, for `refresh` after each optimizer
    step."""
    swapped = []
    for module in list(drafter.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                new = Bf16Linear(child)
                setattr(module, child_name, new)
                swapped.append(new)

    def refresh_changed(_module, _args) -> None:
        for linear in swapped:
            linear.refresh_if_changed()

    drafter.register_forward_pre_hook(refresh_changed)
    return swapped


def refresh(linears: list[Bf16Linear]) -> None:
    """Copy every weight into its bf16 copy: after an optimizer step."""
    for linear in linears:
        linear.refresh()
