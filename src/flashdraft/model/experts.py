"""`train.target_experts: gather_sum`: transformers' grouped-GEMM experts with each token's outputs
summed as a pointwise pass.

transformers' grouped_mm experts (integrations/moe.py) sort the token-expert pairs by expert, run each
expert's rows through `torch._grouped_mm`, then put the rows back in token order and sum each token's
top-k of them, a gather and a reduction over k. Profiled on an H200 (qwen3-30b-a3b in flashdraft's
bench, 12,288 tokens, top-8, compiled target layers), inductor makes that sum one reduction kernel
whose gathered reads run at 0.6 TB/s: 0.69 ms of a layer's 4.3, against 1.6 ms for both expert GEMMs.
Here the sum is k gathered slices added one after another, in fp32, which inductor fuses into one
pointwise kernel whose reads run along the hidden dimension. Everything before the sum is transformers'
path (its `_grouped_linear`, the module's gate and activation). Only the target's features forward
uses it: `train.target_experts: auto` (the default) takes it where the model's own choice is grouped_mm,
and any other name there (the bench's `--target-experts`) keeps that one. Measured on the same shape:
the target forward 199 -> 173 ms a step, the step 412 -> 384 ms (docs/results.md).
"""

from __future__ import annotations

import torch
from torch import nn

from flashdraft.model.target import has_experts

NAME = "gather_sum"


def gather_sum_experts(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-function interface: hidden_states [tokens, D], top_k_index and
    top_k_weights [tokens, k] -> [tokens, D]."""
    from transformers.integrations.moe import _grouped_linear

    tokens, k = top_k_index.shape
    # the token-expert pairs by expert; the narrowest key sorts in the fewest radix passes (an int64 key
    # takes eight on CUDA: 0.05 ms of a qwen3-30b-a3b layer, profiled on an H200)
    narrow = torch.uint8 if self.num_experts <= 256 else torch.int16
    keys, order = torch.sort(top_k_index.reshape(-1).to(narrow))
    expert_ids = keys.int()  # an index (a uint8 tensor would index as a mask)
    rows = hidden_states[order // k]
    counts_of = expert_ids if rows.is_cuda else expert_ids.float()  # histc: int on CUDA, float on CPU
    counts = torch.histc(counts_of, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    up = "gate_up_proj" if self.has_gate else "up_proj"
    out = _grouped_linear(rows, getattr(self, up), offsets, _bias(self, up, expert_ids), self.is_transposed)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    down_bias = _bias(self, "down_proj", expert_ids)
    out = _grouped_linear(out, self.down_proj, offsets, down_bias, self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    # pair j of token t (t * k + j in token order) is row where[t, j] of `out`
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel(), device=order.device)
    where = where.view(tokens, k)
    weights = top_k_weights.float()
    total = out[where[:, 0]].float() * weights[:, :1]
    for j in range(1, k):
        total = total + out[where[:, j]].float() * weights[:, j : j + 1]
    return total.to(hidden_states.dtype)


def _bias(module: nn.Module, proj: str, expert_ids: torch.Tensor) -> torch.Tensor | None:
    return getattr(module, f"{proj}_bias")[expert_ids] if module.has_bias else None


def register() -> None:
    """Makes NAME an experts implementation transformers accepts (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, gather_sum_experts)


def set_target_experts(model: nn.Module, name: str) -> None:
    """`train.target_experts`: "auto" takes NAME where the model's own choice is grouped_mm (the same
    computation, summed faster) and leaves any other; any other name is set as given. Both on a model with
    routed experts only: a name other than auto is refused on one without. NAME has no expert parallelism
    (transformers' sentinel rows): auto leaves such a model's own choice, and asking for NAME is refused."""
    if not has_experts(model):
        if name != "auto":
            raise ValueError(f"train.target_experts {name!r}: the target has no routed experts; use auto")
        return
    parallel = any(getattr(m, "_is_expert_parallel", False) for m in model.modules())
    if name == "auto":
        if parallel or model.config.get_text_config()._experts_implementation != "grouped_mm":
            return
        name = NAME
    if name == NAME:
        if parallel:
            raise ValueError(
                f"train.target_experts {NAME!r}: the target's experts are expert-parallel; use auto"
            )
        register()
    model.set_experts_implementation(name)
