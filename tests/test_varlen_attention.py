"""The target attention "varlen" (flashdraft.model.varlen_attention): the glue between transformers and
torch's variable-length kernel. The kernel runs on CUDA only, so here it is a plain-torch stand-in with
the semantics torch documents (documents cut at cumulative lengths, causal, a window of `left` keys
before the query); what is tested is that each family's packed rows reach it cut, scaled, grouped and
windowed so that the features equal sdpa's, and that decoding with a cache stays on sdpa."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from families import FAMILIES, build
from flashdraft.model import varlen_attention as va
from flashdraft.model.target import Target
from flashdraft.train import target_attention as ta

VOCAB = 96


def reference_kernel(gqa: bool = True, shift_window: int = 0, heads: list | None = None):
    """torch's varlen_attn as documented, in plain torch; `gqa` False: torch 2.11's kernel, which has no
    enable_gqa and takes grouped heads unasked; `shift_window`: a wrong window, for the guard's test;
    `heads`: gets the query and key/value head counts of each call."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        assert max_q == max_k >= int(cu_q.diff().max())
        if heads is not None:
            heads.append((q.shape[1], k.shape[1]))
        if k.shape[1] != q.shape[1]:
            assert enable_gqa, "grouped heads without enable_gqa"
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        left, right = window_size
        out = torch.empty(q.shape[:2] + v.shape[-1:], dtype=q.dtype)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            i = torch.arange(b - a)[:, None]
            j = torch.arange(b - a)[None]
            seen = (j <= i + right) if right >= 0 else torch.ones_like(i - j, dtype=torch.bool)
            if left >= 0:
                seen &= j >= i - left - shift_window
            part = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), attn_mask=seen,
                scale=scale,
            )  # fmt: skip
            out[a:b] = part.transpose(0, 1)
        return out

    if not gqa:

        def plain(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            grouped = k.shape[1] != q.shape[1]
            return kernel(
                q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=grouped
            )

        return plain
    return kernel


def packed(rows: int = 2, lengths=(13, 9, 20), pad: int = 3):
    """Rows of documents end to end (positions restarting at 0), padding at the end at position 0."""
    g = torch.Generator().manual_seed(1)
    width = sum(lengths) + pad
    ids = torch.randint(3, VOCAB, (rows, width), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])
    return ids, positions.expand(rows, -1).clone()


def target_of(family: str) -> Target:
    model = build(family, VOCAB, eos_token_id=1, pad_token_id=0)
    return Target(model, [1, 3])


def test_cumulative_lengths_cut_at_every_document_row_and_padding_token():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [3, 4, 0, 1, 2, 3, 4]])  # the second row mid-document
    cu, longest = va.cumulative_lengths(positions, (2, 7), "cpu")
    assert cu.tolist() == [0, 3, 5, 6, 7, 9, 14] and cu.dtype == torch.int32 and longest == 5
    cu, longest = va.cumulative_lengths(None, (3, 4), "cpu")
    assert cu.tolist() == [0, 4, 8, 12] and longest == 4


PACKED_BY_POSITIONS = [f for f, (_, _, packing) in FAMILIES.items() if packing == "positions"]


@pytest.mark.parametrize("gqa", [True, False], ids=["enable_gqa", "torch_2_11"])
@pytest.mark.parametrize("family", PACKED_BY_POSITIONS)
def test_packed_features_equal_sdpas(family, gqa, monkeypatch):
    """Documents longer than the families' window (families.WINDOW, 8), so a wrong window shows. Grouped
    key/value heads reach the kernel unrepeated."""
    heads = []
    monkeypatch.setattr(va, "_kernel", lambda: reference_kernel(gqa, heads=heads))
    target = target_of(family)
    text = target.model.config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    ids, positions = packed()
    want = target.features(ids, positions)
    target.model.set_attn_implementation(va.NAME)
    torch.testing.assert_close(target.features(ids, positions), want, atol=2e-5, rtol=2e-5)
    assert not target.leaks("positions")
    # rows of one document (no position ids) as well
    torch.testing.assert_close(target.features(ids), _with(target, "sdpa", lambda: target.features(ids)))
    assert heads and all(kv == kv_heads for _, kv in heads)


def _with(target: Target, attention: str, forward):
    now = target.model.config._attn_implementation
    target.model.set_attn_implementation(attention)
    try:
        return forward()
    finally:
        target.model.set_attn_implementation(now)


def test_decoding_with_a_cache_stays_on_sdpa(monkeypatch):
    """The speculative-decoding probes decode with the training target: a prefill and a block of
    several tokens against the cache are sdpa's, and the kernel is never called."""
    from transformers import DynamicCache

    monkeypatch.setattr(va, "_kernel", lambda: pytest.fail("the kernel ran while decoding"))
    target = target_of("gemma3_text")
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))

    def decode():
        cache = DynamicCache(config=target.model.config)
        first = target.decode(ids[:, :20], cache, logits_to_keep=1)
        return first, target.decode(ids[:, 20:], cache)

    want = decode()
    target.model.set_attn_implementation(va.NAME)
    torch.testing.assert_close(decode(), want)


def test_what_the_kernel_cannot_do_is_an_error():
    q = torch.zeros(1, 2, 4, 8)
    with va.documents(None, (1, 4), "cpu"):
        with pytest.raises(NotImplementedError, match="softcap"):
            va.varlen_attention(None, q, q, q, None, softcap=30.0)
        with pytest.raises(NotImplementedError, match="causal"):
            va.varlen_attention(None, q, q, q, None, is_causal=False)
    assert va._documents is None  # held for the forward only


def test_auto_refuses_a_candidate_whose_features_differ_from_the_models_own(monkeypatch):
    """A kernel with a wrong window keeps documents apart (the packing probe passes) but not what the
    model computes: the guard refuses it and says by how much."""
    monkeypatch.setattr(va, "_kernel", lambda: reference_kernel(shift_window=4))
    monkeypatch.setattr(va, "available", lambda: True)
    target = target_of("mistral")
    ids, positions = packed()
    choice = ta.choose_target_attention(target, ids, positions, None, (va.NAME,), repeats=1)
    assert choice.name == "sdpa" and va.NAME not in choice.ms
    assert "differ from sdpa's by" in choice.refused[va.NAME]

    monkeypatch.setattr(va, "_kernel", lambda: reference_kernel())
    choice = ta.choose_target_attention(target, ids, positions, None, (va.NAME,), repeats=1)
    assert set(choice.ms) == {"sdpa", va.NAME} and choice.differs[va.NAME] < 1e-4
    assert f"{va.NAME} " in choice.line() and "apart" in choice.line()


def test_the_reference_kernel_has_torchs_signature():
    """The stand-in is called as torch's kernel is, where this torch has one."""
    kernel = va._kernel()
    if kernel is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    ours = inspect.signature(reference_kernel()).parameters.values()
    named = {p.name for p in ours if p.kind is p.KEYWORD_ONLY}  # the rest goes by position
    assert named == {"scale", "window_size", "enable_gqa"}
    assert named <= set(inspect.signature(kernel).parameters)


calls = []  # (cumulative lengths, longest) of each call of the op


@torch.library.custom_op("flashdraft_tests::varlen", mutates_args=())
def _varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float, left: int
) -> torch.Tensor:
    calls.append((cu.tolist(), longest))
    return reference_kernel()(
        q, k, v, cu, cu, longest, longest, scale=scale, window_size=(left, 0), enable_gqa=True
    )


@_varlen_op.register_fake
def _(q, k, v, cu, longest, scale, left):
    return q.new_empty(q.shape[:2] + v.shape[-1:])


def op_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """The stand-in as one opaque operator, as torch's kernel is one (torch_attn::_varlen_attn): a compiled
    layer can hold it in its graph."""
    return _varlen_op(q, k, v, cu_q, max_q, scale, window_size[0])


def test_compiled_target_layers_hold_the_kernel_and_take_batches_of_other_documents(monkeypatch):
    """Training compiles each target layer (dynamic=False). The kernel runs inside the layer's graph, with
    no graph break, and the row's length as the longest document; a batch cut into other documents than
    the first reaches it with its own lengths and compiles nothing again."""
    from torch._dynamo.utils import counters

    from flashdraft.model.target import decoder_layers

    monkeypatch.setattr(va, "_kernel", lambda: op_kernel)
    target = target_of("qwen3")
    target.model.set_attn_implementation(va.NAME)
    torch._dynamo.reset()
    counters.clear()
    for layer in decoder_layers(target.model)[2]:
        layer.forward = torch.compile(layer.forward, dynamic=False, backend="eager")
    first, second = packed(lengths=(13, 9, 20)), packed(lengths=(30, 5), pad=10)
    target.features(*first)
    assert not counters["graph_break"], dict(counters["graph_break"])
    calls.clear()
    with torch.compiler.set_stance("fail_on_recompile"):
        got = target.features(*second)
    cut = [0, 30, *range(35, 45), 45, 75, *range(80, 90), 90]  # padding: a document of one token each
    assert calls and all(c == (cut, 45) for c in calls)
    target.model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, target.features(*second), atol=2e-5, rtol=2e-5)
