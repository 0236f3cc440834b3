"""Decoding attention that reads each key/value head once: grouped-query attention without repeat_kv.

Hand-written because transformers' "sdpa" attention, given a mask, expands the key/value heads to the
query heads (`repeat_kv`) and packs one query token's heads into their groups only outside
torch.compile. A compiled decoding step on a static cache (`LocalBackend(cache="static")`) therefore
copies the whole cache `num_key_value_groups` times in every layer and step, and attends over the copy:
on the proof's target (12 query heads, 4 key/value heads) at batch 8192 on an H200 the copy took 41%
and the attention 39% of the GPU time (`benchmarks/proof_stages.py --profile`, docs/results.md).

Here one query token's heads are laid out as (key/value head, group) rows, so SDPA attends each cached
head once, compiled or not. Everything else (prefill, several query tokens, no groups) is transformers'
sdpa, unchanged; masks come from transformers' sdpa mask builder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "grouped_decode_sdpa"  # no "flash" in it: transformers would look for a flash kernel


def grouped_sdpa(
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
    batch, heads, q_len, dim = query.shape
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    if q_len != 1 or groups == 1 or not shared_mask or kwargs.get("position_bias") is not None:
        options = dict(dropout=dropout, scaling=scaling, is_causal=is_causal)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **options, **kwargs)
    grouped = query.reshape(batch, heads // groups, groups, dim)  # heads are numbered kv-head-major
    out = F.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def use_grouped_attention(model) -> bool:
    """Switch a model on transformers' sdpa attention to `grouped_sdpa` (registered once); a model on
    another implementation (flash, eager) is left as it is. Returns whether it was switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation not in ("sdpa", NAME):
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
