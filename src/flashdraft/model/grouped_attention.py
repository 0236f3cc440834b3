"""Decoding attention that reads each key/value head once: grouped-query attention without repeat_kv.

Hand-written because transformers' "sdpa" attention, given a mask, expands the key/value heads to the
query heads (`repeat_kv`) and packs one query token's heads into their groups only outside
torch.compile. A compiled decoding step on a static cache (`LocalBackend(cache="static")`) therefore
copies the whole cache `num_key_value_groups` times in every layer and step, and attends over the copy:
on the proof's target (12 query heads, 4 key/value heads) at batch 8192 on an H200 the copy took 41%
and the attention 39% of the GPU time (`experiments/studies/proof_stages.py --profile`, docs/results.md).

Here one query token's heads are laid out as (key/value head, group) rows, so each cached head is read
once, and attend by one of three kernels:
- "matmul" (the default): two batched matmuls around a float32 softmax, as transformers' eager
  attention computes it, left to the compiler;
- "matmul_t": the same products transposed, the cache the left operand (for cuBLAS's kernel choice);
- "sdpa": torch's SDPA, which picks cuDNN on a GPU.
At the regeneration's shapes on an H200 (batch 8192, 4 key/value heads, 192 cached tokens,
`benchmarks/decode_attention.py`) compiled matmul took 0.64 ms a call (2.5 TB/s of cache read), SDPA
1.41 ms, transformers' repeat_kv SDPA 3.52 ms, and flex_attention with enable_gqa 165 ms (not kept).
Everything else (prefill, several query tokens, no groups) is transformers' sdpa, unchanged; masks
come from transformers' sdpa mask builder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# no "flash" in the names: transformers would look for a flash kernel
NAMES = {
    "matmul": "grouped_decode_matmul",
    "matmul_t": "grouped_decode_matmul_t",
    "sdpa": "grouped_decode_sdpa",
}


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _by_group(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, 1, D) -> (B, H_kv, H / H_kv, D): query heads are numbered kv-head-major."""
    batch, heads, _, dim = query.shape
    return query.reshape(batch, kv_heads, heads // kv_heads, dim)


def attend_sdpa(query, key, value, mask, scale):
    """query (B, H, 1, D), key/value (B, H_kv, S, D), mask (B, 1, 1, S) or None -> (B, H, 1, D)."""
    out = F.scaled_dot_product_attention(
        _by_group(query, key.shape[1]), key, value, attn_mask=mask, scale=scale
    )
    return out.reshape(query.shape[:3] + value.shape[-1:])


def _probabilities(scores: torch.Tensor, mask, scale, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Float32 softmax of scaled, masked scores, rounded to `dtype` as transformers' eager attention does."""
    scores = scores.float() * (scale or dim**-0.5)
    if mask is not None:
        scores = scores + _additive(mask, scores.dtype)
    return scores.softmax(-1).to(dtype)


def attend_matmul(query, key, value, mask, scale):
    """As attend_sdpa; the probabilities rounded to the value's dtype, as transformers' eager attention."""
    scores = torch.matmul(_by_group(query, key.shape[1]), key.transpose(-1, -2))
    out = torch.matmul(_probabilities(scores, mask, scale, query.shape[-1], value.dtype), value)
    return out.reshape(query.shape[:3] + value.shape[-1:])


def attend_matmul_t(query, key, value, mask, scale):
    """As attend_matmul, each product transposed so that the cache is the left operand: (S, D) x (D, G)
    and (D, S) x (S, G) instead of (G, D) x (D, S) and (G, S) x (S, D), G the group of 3 query heads.
    Inside the compiled decoding step at batch 8192 a slow sm75 WMMA bmm kernel took 1.10 ms a layer,
    likely the first form's score product (docs/results.md); this form gives cuBLAS other shapes."""
    scores = torch.matmul(key, _by_group(query, key.shape[1]).transpose(-1, -2)).transpose(-1, -2)
    probs = _probabilities(scores, mask, scale, query.shape[-1], value.dtype)
    out = torch.matmul(value.transpose(-1, -2), probs.transpose(-1, -2)).transpose(-1, -2)
    return out.reshape(query.shape[:3] + value.shape[-1:])


KERNELS = {"matmul": attend_matmul, "matmul_t": attend_matmul_t, "sdpa": attend_sdpa}


def _grouped(kernel: str):
    attend = KERNELS[kernel]

    def grouped_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention-interface signature: query (B, H, 1, D), key/value (B, H_kv, S, D),
        mask (B, 1, 1, S) or None; returns (B, 1, H, D)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        groups = getattr(module, "num_key_value_groups", 1)
        shared_mask = attention_mask is None or attention_mask.shape[1] == 1
        other = dropout or kwargs.get("position_bias") is not None
        if query.shape[2] != 1 or groups == 1 or not shared_mask or other:
            options = dict(dropout=dropout, scaling=scaling, is_causal=is_causal)
            return sdpa_attention_forward(module, query, key, value, attention_mask, **options, **kwargs)
        return attend(query, key, value, attention_mask, scaling).transpose(1, 2), None

    grouped_attention.__name__ = NAMES[kernel]
    return grouped_attention


def use_grouped_attention(model, kernel: str = "matmul") -> bool:
    """Switch a model on transformers' sdpa attention to grouped decoding attention on `kernel`
    (registered under NAMES[kernel]); a model on another implementation (flash, eager) is left as it
    is. Returns whether it was switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if kernel not in KERNELS:
        raise ValueError(f"grouped attention kernel must be one of {sorted(KERNELS)}, not {kernel!r}")
    if model.config._attn_implementation not in ("sdpa", *NAMES.values()):
        return False
    AttentionInterface.register(NAMES[kernel], _grouped(kernel))
    AttentionMaskInterface.register(NAMES[kernel], sdpa_mask)
    model.set_attn_implementation(NAMES[kernel])
    return True
