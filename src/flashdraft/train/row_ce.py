"""The loss's pass over one chunk of logits as a Triton kernel: each row's log-sum-exp, its label's logit
and its argmax from a single read of the bf16 logits; the backward (softmax minus one-hot) is compiled.

Why by hand: for the same three results, torch.compile's fused reduction (flashdraft.train.loss's
compiled chunk) reads a Qwen3-8B chunk's 2.5 GB of logits at about 1.3 TB/s on an H100; one program a
row holding a running maximum, sum of exponentials and argmax as scalars reads them at 2.4 TB/s, 1.05
against 1.94 ms a chunk (`benchmarks/loss_pass.py`, docs/results.md). The fused linear cross-entropy
kernels of liger-kernel and cut-cross-entropy return no argmax, which the step needs for its slot
accuracy and acceptance length.

GPU only (Triton); flashdraft.train.loss uses it for the plain objective (no distillation, no logit
scale or cap, no candidate top-k) when the step is compiled on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 8192  # the row's columns one loop step reads: the fastest of 2048/4096/8192 on the H100


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
    tile = min(tile, triton.next_power_of_2(vocab))
    _row_stats[(rows,)](
        logits, logits.stride(0), labels, lse, label_logit, argmax, vocab, TILE=tile, num_warps=8
    )
    return lse, label_logit, argmax


def grad_logits(
    logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """d(sum grad x CE)/d logits: (softmax - one-hot) x grad per row, 0 on a row with a negative label."""
    p = torch.exp(logits.float() - lse[:, None])
    one_hot = torch.arange(logits.shape[1], device=logits.device)[None, :] == labels[:, None]
    return ((p - one_hot.float()) * (grad * (labels >= 0))[:, None]).to(logits.dtype)


_compiled_grad_logits = torch.compile(grad_logits, dynamic=False)


class _RowCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tile):
        lse, label_logit, argmax = row_stats(logits, labels, tile)
        ctx.save_for_backward(logits, lse, labels)
        ctx.mark_non_differentiable(argmax)
        return lse - label_logit, argmax

    @staticmethod
    def backward(ctx, grad, _):
        logits, lse, labels = ctx.saved_tensors
        return _compiled_grad_logits(logits, lse, labels, grad), None, None


def row_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tile: int = TILE
) -> tuple[torch.Tensor, torch.Tensor]:
    """F.cross_entropy(logits.float(), labels, reduction="none") and logits.argmax(-1), from one read of
    logits [rows, vocab]; the loss carries a gradient to logits."""
    return _RowCrossEntropy.apply(logits.contiguous(), labels.contiguous(), tile)
