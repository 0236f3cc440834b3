"""The target attention "varlen": packed rows through torch's variable-length flash kernel.

A packed row holds several documents. transformers keeps them apart under sdpa with a dense [S, S]
mask per row, which takes SDPA off its flash kernel, and under flex_attention with a block mask. A
variable-length kernel instead takes the documents as one list of tokens cut at cumulative lengths
and computes only what each document sees. transformers reaches such kernels only through the
flash-attn package or kernels downloaded from the hub; torch (2.11 and later) ships one,
`torch.nn.attention.varlen.varlen_attn` (CUDA only). This module is the glue between the two:

- `documents` turns a batch's position ids (which restart at 0 in each document, and at 0 on each
  padding token) into the cumulative lengths, once per forward, and holds them while `Target` runs
  the forward.
- `varlen_attention`, registered with transformers as "varlen", runs the kernel on them (causal, the
  layer's sliding window as transformers defines it: a query sees the `sliding_window` keys up to
  itself), and transformers' own sdpa outside such a forward (decoding with a KV cache), with the mask
  transformers builds for sdpa (the "varlen" mask is sdpa's).

The lengths reach the attention beside the model's arguments rather than through them. In a compiled
target layer the kernel is part of the layer's graph, which must hold for every batch: the lengths are
marked dynamic (the number of documents changes from batch to batch), and the longest document is given
as the row's length, which bounds it (the kernel's early exit skips the query blocks past a document's
end). Eager, the kernel gets the longest document itself.

Not supported (an error, so that `train.target_attention: auto` refuses the candidate and says why):
attention softcapping, attention sinks, dropout, non-causal attention. Whether it is faster than sdpa or
flex_attention depends on the model and the shape: auto measures it (flashdraft.train.target_attention).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "varlen"  # no "flash" in it: transformers would look for a flash kernel package


class Unsupported(NotImplementedError):
    """What torch's kernel cannot compute (softcapping, sinks, dropout, non-causal attention) or a torch
    without the kernel: a refusal, not unfinished work. `train.target_attention: auto` then refuses the
    candidate and names why; an explicit `varlen` stops with this message."""


# (cumulative lengths, longest document, row length, the kernel, its options) of the running forward
_documents: tuple[torch.Tensor, int, int, Callable, dict] | None = None


def available() -> bool:
    """Whether torch has the kernel and a GPU to run it on."""
    return torch.cuda.is_available() and _kernel() is not None


@functools.cache
def _kernel():  # looked up once: every forward asks
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _takes(kernel, name: str) -> bool:
    return name in inspect.signature(kernel).parameters


def cumulative_lengths(
    position_ids: torch.Tensor | None, shape: tuple[int, int], device
) -> tuple[torch.Tensor, int]:
    """The documents' cumulative lengths over the flattened batch (int32, on `device`) and the longest
    document. position_ids None: each row one document."""
    batch, length = shape
    if position_ids is None:
        cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)
        return cu.to(device, non_blocking=True), length
    starts = position_ids.detach().to("cpu").eq(0)  # one copy to the host a forward
    starts[:, 0] = True  # a row starts a document whatever its first position says
    first = starts.flatten().nonzero().flatten()
    cu = torch.cat([first, torch.tensor([batch * length])]).to(torch.int32)
    return cu.to(device, non_blocking=True), int(cu.diff().max())


@contextlib.contextmanager
def documents(position_ids: torch.Tensor | None, shape: tuple[int, int], device):
    """The documents of one packed forward, held for its attention calls while it runs. Everything a
    compiled layer must not trace is settled here: the lengths marked dynamic, the kernel's options."""
    global _documents
    cu, longest = cumulative_lengths(position_ids, shape, device)
    torch._dynamo.mark_dynamic(cu, 0)
    kernel = _kernel()
    if kernel is None:
        raise Unsupported(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    # Grouped heads go in as they are: query head h reads key/value head h // groups, as transformers'
    # repeat_kv lays them out. A torch with `enable_gqa` asks for the flag; torch 2.11's kernel has none
    # and takes them unasked (dev/varlen_check.py on an H200: the output equal to that of heads repeated
    # first, 0.395 against 0.574 ms for 4 rows of 3,072 tokens, 32 query and 4 key/value heads).
    grouped = {"enable_gqa": True} if _takes(kernel, "enable_gqa") else {}
    _documents = cu, longest, shape[1], kernel, grouped
    try:
        yield
    finally:
        _documents = None


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query (B, H, S, D), key/value (B, H_kv, S, D) ->
    ((B, S, H, D), None)."""
    if _documents is None:  # not a packed forward: decoding with a KV cache
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise Unsupported(f"varlen attention has no {name}")
    if dropout or kwargs.get("is_causal") is False:
        raise Unsupported("varlen attention is causal and without dropout")
    cu, longest, row, kernel, grouped = _documents
    if torch.compiler.is_compiling():
        longest = row  # what any batch's longest document is within: one graph for every cut
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k = key.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    v = value.transpose(1, 2).reshape(batch * length, kv_heads, value.shape[-1])
    options = {"scale": scaling, **(grouped if kv_heads != heads else {})}
    options["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    out = kernel(q, k, v, cu, cu, longest, longest, **options)
    return out.reshape(batch, length, heads, out.shape[-1]), None


AttentionInterface.register(NAME, varlen_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
