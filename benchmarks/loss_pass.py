"""The loss's pass over one chunk of logits: torch.compile's fused reduction against flashdraft.train.row_ce's
Triton kernel, which the compiled step uses on CUDA for the plain objective.

Per chunk of draft positions the loss computes bf16 logits = h @ lm_head^T (8,192 x 151,936 at Qwen3's
vocabulary), then each row's log-sum-exp, the label's logit and the argmax. Variants, each timed forward
and forward + backward (the gradient reaching h), with the lm_head matmul alone beside them:

- compiled: flashdraft.train.loss's compiled chunk (matmul and reduction in one torch.compile);
- argmax-apart: the compiled loss without the argmax, then the argmax on its own;
- row TILE: row_ce's kernel reading TILE columns a loop step (the default is row_ce.TILE).

Each variant's loss, argmax and gradient are checked against the compiled chunk's first. The pass's
bandwidth is the chunk's bytes over the variant's forward less the matmul's. Figures are medians of
--iters CUDA-event timings after warm-up. GPU only (Triton).

    python benchmarks/loss_pass.py [--shape qwen3-8b] [--rows 8192] [--iters 20]
"""

import argparse

import torch
import torch.nn.functional as F
from decode_attention import median_ms

from flashdraft.bench import shape_config
from flashdraft.train import row_ce
from flashdraft.train.loss import _compiled_chunk_ce


def row_pass(tile: int):
    def run(h, w, labels):
        return row_ce.linear_cross_entropy(h, w, labels, tile)

    return run


@torch.compile(dynamic=False)
def _loss_alone(h, w, labels):
    raw = h @ w.t()
    return F.cross_entropy(raw.float(), labels, reduction="none"), raw


def argmax_apart(h, w, labels):
    loss, raw = _loss_alone(h, w, labels)
    return loss, raw.detach().argmax(-1)


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

    variants = {"compiled": _compiled_chunk_ce, "argmax-apart": argmax_apart}
    variants |= {f"row {tile}": row_pass(tile) for tile in (2048, 4096, 8192)}
    ref_loss, ref_pred = _compiled_chunk_ce(h, w, labels)[:2]
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
        print(f"{name:14s} {fwd:11.3f} {full:11.3f} {rest:8.3f} {gb / rest if rest > 0 else 0:10.2f}")


if __name__ == "__main__":
    main()
