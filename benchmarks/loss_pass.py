"""The loss's pass over one chunk of logits, as the step runs it and as two candidates would, measured
before either is built into flashdraft.train.loss.

The step's loss computes, per chunk of draft positions, bf16 logits = h @ lm_head^T (8,192 x 151,936 at
Qwen3's vocabulary), then in one compiled reduction each row's log-sum-exp, the label's logit and the
argmax. On an H200 that reduction read the chunk's 2.5 GB at about 0.9 TB/s (docs/results.md), a
quarter of the card's bandwidth. Variants, each timed forward and forward + backward (the gradient
reaching h), with the lm_head matmul alone beside them:

- step: flashdraft.train.loss's compiled chunk, as the step calls it;
- argmax-apart: the same compiled loss without the argmax, then the argmax of the bf16 logits on its
  own (whether the fused argmax is what slows the reduction);
- triton: one program a row walks the row once with a running maximum, sum of exponentials and argmax
  held as scalars (below); the backward is softmax minus one-hot, compiled.

Each variant's loss, argmax and gradient are checked against the step's first. The pass's bandwidth is
the chunk's bytes over the variant's forward less the matmul's. Figures are medians of --iters CUDA-event
timings after warm-up. GPU only (Triton).

    python benchmarks/loss_pass.py [--shape qwen3-8b] [--rows 8192] [--iters 20]
"""

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from decode_attention import median_ms

from flashdraft.bench import shape_config
from flashdraft.train.loss import _compiled_chunk_ce


@triton.jit
def _row_stats(raw, stride, labels, lse_out, label_out, argmax_out, vocab: tl.constexpr, BLOCK: tl.constexpr):
    """Per row of raw [rows, vocab] bf16: log-sum-exp, the label's logit (0 and lse for a label of
    -100, cross_entropy's ignore_index) and the argmax, in one read of the row."""
    row = tl.program_id(0).to(tl.int64)
    base = raw + row * stride
    running_max = tl.full((), -1e30, tl.float32)
    total = tl.full((), 0.0, tl.float32)
    best = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        block_arg = tl.argmax(x, 0) + start
        new_max = tl.maximum(running_max, block_max)
        total = total * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        best = tl.where(block_max > running_max, block_arg, best)
        running_max = new_max
    lse = running_max + tl.log(total)
    label = tl.load(labels + row)
    picked = tl.load(base + tl.maximum(label, 0)).to(tl.float32)
    tl.store(lse_out + row, lse)
    tl.store(label_out + row, tl.where(label >= 0, picked, lse))
    tl.store(argmax_out + row, best.to(tl.int64))


def row_stats(raw: torch.Tensor, labels: torch.Tensor, block: int = 4096):
    rows, vocab = raw.shape
    lse = torch.empty(rows, device=raw.device, dtype=torch.float32)
    label_logit = torch.empty_like(lse)
    pred = torch.empty(rows, device=raw.device, dtype=torch.int64)
    _row_stats[(rows,)](raw, raw.stride(0), labels, lse, label_logit, pred, vocab, BLOCK=block, num_warps=8)
    return lse, label_logit, pred


@torch.compile(dynamic=False)
def _softmax_minus_one_hot(raw, lse, labels, grad):
    p = torch.exp(raw.float() - lse[:, None])
    one_hot = torch.arange(raw.shape[1], device=raw.device)[None, :] == labels[:, None]
    return ((p - one_hot.float()) * grad[:, None]).to(raw.dtype)


class _TritonCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw, labels, block):
        lse, label_logit, pred = row_stats(raw, labels, block)
        ctx.save_for_backward(raw, lse, labels)
        ctx.mark_non_differentiable(pred)
        return lse - label_logit, pred

    @staticmethod
    def backward(ctx, grad, _):
        raw, lse, labels = ctx.saved_tensors
        return _softmax_minus_one_hot(raw, lse, labels, grad), None, None


def triton_ce(h, w, labels, block=4096):
    return _TritonCE.apply(h @ w.t(), labels, block)


@torch.compile(dynamic=False)
def _loss_alone(h, w, labels):
    raw = h @ w.t()
    return F.cross_entropy(raw.float(), labels, reduction="none"), raw


def argmax_apart(h, w, labels):
    loss, raw = _loss_alone(h, w, labels)
    return loss, raw.detach().argmax(-1)


def step_ce(h, w, labels):
    return _compiled_chunk_ce(h, w, labels)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-8b", help="a bench shape: its vocabulary and width")
    parser.add_argument("--rows", type=int, default=8192, help="draft positions a chunk (block_loss's)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    target = shape_config(args.shape)
    args.vocab, args.width = target.vocab_size, target.hidden_size
    torch.manual_seed(0)
    dev = "cuda"
    h = (torch.randn(args.rows, args.width, device=dev) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(args.vocab, args.width, device=dev) * 0.02).bfloat16()
    labels = torch.randint(0, args.vocab, (args.rows,), device=dev)
    weights = torch.rand(args.rows, device=dev)

    def forward(fn):
        with torch.no_grad():
            return fn(h, w, labels)

    def both(fn):
        loss, _ = fn(h, w, labels)
        (loss * weights).sum().backward()
        h.grad = None

    variants = {"step": step_ce, "argmax-apart": argmax_apart, "triton": triton_ce}
    for block in (2048, 8192):  # the row's tile a loop step reads (triton: 4096)
        variants[f"triton {block}"] = lambda h, w, labels, block=block: triton_ce(h, w, labels, block)
    ref_loss, ref_pred = step_ce(h, w, labels)[:2]
    (ref_loss * weights).sum().backward()
    ref_grad, h.grad = h.grad, None
    for name, fn in variants.items():
        loss, pred = fn(h, w, labels)[:2]
        (loss * weights).sum().backward()
        grad, h.grad = h.grad, None
        loss_err = ((loss - ref_loss).abs().max() / ref_loss.abs().max()).item()
        grad_err = ((grad.float() - ref_grad.float()).norm() / ref_grad.float().norm()).item()
        agree = (pred == ref_pred).float().mean().item()
        print(
            f"{name:14s} loss error {loss_err:.1e}, argmax agrees {agree:.4%}, gradient error {grad_err:.1e}"
        )
        assert loss_err < 1e-3 and agree > 0.99 and grad_err < 2e-2, name  # bf16 logits tie often

    matmul = median_ms(lambda: h.detach() @ w.t(), (), args.iters)
    gb = args.rows * args.vocab * 2 / 1e9
    print(f"\nlm_head matmul alone: {matmul:.3f} ms; the chunk's logits: {gb:.2f} GB")
    print(f"{'variant':14s} {'forward ms':>11s} {'fwd+bwd ms':>11s} {'pass ms':>8s} {'pass TB/s':>10s}")
    for name, fn in variants.items():
        fwd = median_ms(forward, (fn,), args.iters)
        full = median_ms(both, (fn,), args.iters)
        rest = fwd - matmul
        print(f"{name:14s} {fwd:11.3f} {full:11.3f} {rest:8.3f} {gb / rest / 1e3 if rest > 0 else 0:10.2f}")


if __name__ == "__main__":
    main()
