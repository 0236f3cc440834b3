"""The loss's pass over one chunk of logits as Triton kernels: forward, each row's log-sum-exp, its
label's logit and its argmax from a single read of the bf16 logits; backward, softmax minus one-hot
written over the logits themselves, so a chunk holds one [rows, vocab] buffer, not two.

Why by hand: for the same three results, torch.compile's fused reduction (flashdraft.train.loss's
compiled chunk) reads a Qwen3-8B chunk's 2.5 GB of logits in 1.9-2.4 ms on an H100; one program a row
holding a running maximum, sum of exponentials and argmax as scalars reads them in 1.0-2.0 ms, and the
chunk's forward and backward take 31.2 against 32.9 ms (`benchmarks/loss_pass.py`, docs/results.md).
The fused linear cross-entropy kernels of liger-kernel and cut-cross-entropy return no argmax, which
the step needs for its slot accuracy and acceptance length.

GPU only (Triton); flashdraft.train.loss uses it for the plain objective (no distillation, no logit
scale or cap, no candidate top-k) when the step is compiled on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the row's columns one loop step reads: of 2048/4096/8192, the fastest forward and backward on an H100
TILE = 8192


def _tile(tile: int, vocab: int) -> int:
    """The columns a loop step reads: tile, or fewer for a row narrower than it."""
    return min(tile, triton.next_power_of_2(vocab))


@triton.jit
def _row_stats(
    logits, stride, labels, lse_out, label_out, argmax_out, vocab: tl.constexpr, TILE: tl.constexpr
):
    """Row r of logits [rows, vocab]: its log-sum-exp, its label's logit (the log-sum-exp itself for a
    negative label, cross_entropy's ignore_index, so that its loss is 0) and its first argmax."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    running_max = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    best = tl.full((), 0, tl.int32)
    for start in range(0, vocab, TILE):
        cols = start + tl.arange(0, TILE)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(x, 0)
        new_max = tl.maximum(running_max, tile_max)
        # the first tile's running maximum is -inf: exp(-inf - finite) is 0, the sum's start
        total = total * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        best = tl.where(tile_max > running_max, tl.argmax(x, 0) + start, best)  # strict: the first wins
        running_max = new_max
    lse = running_max + tl.log(total)
    label = tl.load(labels + row)
    picked = tl.load(base + label, mask=(label >= 0) & (label < vocab), other=0.0).to(tl.float32)
    tl.store(lse_out + row, lse)
    tl.store(label_out + row, tl.where(label >= 0, picked, lse))
    tl.store(argmax_out + row, best.to(tl.int64))


def row_stats(
    logits: torch.Tensor, labels: torch.Tensor, tile: int = TILE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (contiguous rows), labels [rows] -> each row's log-sum-exp and label logit
    (float32) and argmax (int64); tile: the columns one loop step reads."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and labels.shape == (rows,), (logits.stride(), labels.shape)
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    label_logit = torch.empty_like(lse)
    argmax = torch.empty(rows, device=logits.device, dtype=torch.int64)
    tile = _tile(tile, vocab)
    _row_stats[(rows,)](
        logits, logits.stride(0), labels, lse, label_logit, argmax, vocab, TILE=tile, num_warps=8
    )
    return lse, label_logit, argmax


@triton.jit
def _grad_in_place(logits, stride, lse, labels, grad, vocab: tl.constexpr, TILE: tl.constexpr):
    """Row r of logits becomes d(grad[r] x CE_r)/d logits: (softmax - one-hot) x grad[r], 0 on a row
    with a negative label."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    label = tl.load(labels + row)
    scale = tl.where(label >= 0, tl.load(grad + row), 0.0)
    row_lse = tl.load(lse + row)
    for start in range(0, vocab, TILE):
        cols = start + tl.arange(0, TILE)
        x = tl.load(base + cols, mask=cols < vocab, other=0.0).to(tl.float32)
        g = (tl.exp(x - row_lse) - (cols == label).to(tl.float32)) * scale
        tl.store(base + cols, g.to(logits.dtype.element_ty), mask=cols < vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    """The logits are this function's own: the backward writes their gradient over them."""

    @staticmethod
    def forward(ctx, h, weight, labels, tile):
        logits = h @ weight.t()
        lse, label_logit, argmax = row_stats(logits, labels, tile)
        ctx.tile = _tile(tile, logits.shape[1])
        ctx.save_for_backward(h if weight.requires_grad else None, weight, logits, lse, labels)
        ctx.mark_non_differentiable(argmax)
        return lse - label_logit, argmax

    @staticmethod
    def backward(ctx, grad, _):
        if getattr(ctx, "overwritten", False):
            raise RuntimeError(
                "linear_cross_entropy: a second backward (retain_graph) would read logits "
                "its first overwrote with their gradient"
            )
        ctx.overwritten = True
        h, weight, logits, lse, labels = ctx.saved_tensors
        rows, vocab = logits.shape
        _grad_in_place[(rows,)](
            logits,
            logits.stride(0),
            lse,
            labels,
            grad.float().contiguous(),
            vocab,
            TILE=ctx.tile,
            num_warps=8,
        )
        grad_h = logits @ weight.to(logits.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (logits.t() @ h.to(logits.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_weight, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tile: int = TILE):
    """F.cross_entropy((h @ weight^T).float(), labels, reduction="none") and the logits' argmax, with one
    read of the logits [rows, vocab] forward and one read and write backward; the loss carries
    gradients to h (and weight, where it requires one)."""
    return _LinearCrossEntropy.apply(h, weight, labels.contiguous(), tile)
