"""Grouped-query decoding attention (flashdraft.model.grouped_attention) against transformers' sdpa."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from flashdraft.model.grouped_attention import KERNELS, _grouped


class Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("compiled", [False, True])
def test_one_query_token_attends_each_key_value_head_like_repeat_kv(kernel, compiled):
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 12, 1, 16), torch.randn(5, 4, 9, 16), torch.randn(5, 4, 9, 16)
    mask = torch.ones(5, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding
    mask[1, ..., 6:] = False  # static-cache slots not written yet
    attention = _grouped(kernel)
    out, _ = (torch.compile(attention) if compiled else attention)(Attention(), q, k, v, mask, scaling=0.25)
    # query head h reads key/value head h // 3, as repeat_kv lays them out
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    assert out.shape == (5, 1, 12, 16)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("q_len", [1, 4])
def test_no_mask_or_several_query_tokens_match_transformers_sdpa(kernel, q_len):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 12, q_len, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    mask = None if q_len == 1 else torch.ones(2, 1, q_len, 6, dtype=torch.bool).tril(2)
    out, _ = _grouped(kernel)(Attention(), q, k, v, mask)
    expected, _ = sdpa_attention_forward(Attention(), q, k, v, mask)
    torch.testing.assert_close(out, expected)
