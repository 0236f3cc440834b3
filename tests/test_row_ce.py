"""flashdraft.train.row_ce, the loss's one-read Triton pass, against torch: on a GPU, and on the CPU under
Triton's interpreter where triton is installed (the CPU torch wheel brings none, so CI skips both)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashdraft.train.loss import block_loss

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check_row_ce(device: str) -> None:
    """The kernels' loss, argmax and gradients (to h and to the weight) against F.cross_entropy and
    argmax, bf16 logits over three tiles, with a maximum tied across tiles (the first must win) and an
    ignored label (-100)."""
    from flashdraft.train import row_ce

    tile = 1024  # three tiles a row at this vocabulary, as Qwen3's takes 19 of 8,192
    torch.manual_seed(0)
    rows, width, vocab = 12, 16, 2500
    h = torch.randn(rows, width).bfloat16().to(device)
    weight = torch.randn(vocab, width).bfloat16().to(device)
    h[0], h[1] = h[0].abs(), -h[1].abs()
    weight[100] = weight[2200] = 2.0  # logits exactly tied at row 0's maximum, in tiles 0 and 2
    weight[1500, :] = weight[1600, :] = -2.0  # and row 1's, in one tile
    labels = torch.randint(0, vocab, (rows,), device=device)
    labels[2] = -100
    grad = torch.rand(rows, device=device)
    x, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, argmax = row_ce.linear_cross_entropy(x, w, labels, tile)
    (loss * grad).sum().backward()
    rx, rw = h.float().requires_grad_(), weight.float().requires_grad_()
    logits = (rx @ rw.t()).bfloat16().float()  # the kernels read bf16 logits
    ref_loss = F.cross_entropy(logits, labels, reduction="none")
    (ref_loss * grad).sum().backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-4, atol=1e-4), (loss - ref_loss).abs().max()
    assert loss[2] == 0
    assert torch.equal(argmax, logits.argmax(-1)) and argmax[0] == 100 and argmax[1] == 1500, argmax[:2]
    assert torch.allclose(x.grad.float(), rx.grad, rtol=2e-2, atol=2e-2), (
        (x.grad.float() - rx.grad).abs().max()
    )
    assert torch.allclose(w.grad.float(), rw.grad, rtol=2e-2, atol=2e-2), (
        (w.grad.float() - rw.grad).abs().max()
    )
    no_grad = x.detach().clone().requires_grad_()  # row 2's label is ignored: no gradient from it
    ignored = row_ce.linear_cross_entropy(no_grad, weight, labels, tile)[0][2]
    ignored.backward(retain_graph=True)
    assert not no_grad.grad.any()
    with pytest.raises(RuntimeError, match="second backward"):  # the logits now hold their gradient
        ignored.backward()


@cuda
def test_row_ce_on_gpu():
    check_row_ce("cuda")


def test_row_ce_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_row_ce; test_row_ce.check_row_ce('cpu')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@cuda
@pytest.mark.parametrize("recompute", [True, False])
def test_block_loss_row_pass_matches_compiled_chunk(recompute, monkeypatch):
    """block_loss on CUDA, compiled, plain objective: row_ce's pass (through the checkpoint's recompute
    too) gives the compiled chunk's loss, hits and gradient."""
    from flashdraft.train import loss as loss_mod

    torch.manual_seed(0)
    b, n, bs, d, vocab = 2, 8, 4, 64, 3000
    hidden = torch.randn(b, n * bs, d, device="cuda", dtype=torch.bfloat16)
    head = (torch.randn(vocab, d, device="cuda") * 0.1).bfloat16()
    labels = torch.randint(0, vocab, (b, n, bs), device="cuda")
    weights = torch.rand(b, n, bs, device="cuda")
    results = []
    calls = []
    for chunk in (loss_mod._row_chunk_ce, loss_mod._compiled_chunk_ce):
        calls.clear()
        monkeypatch.setattr(loss_mod, "_row_chunk_ce", lambda *a, chunk=chunk: calls.append(1) or chunk(*a))
        h = hidden.clone().requires_grad_()
        out = block_loss(h, head, labels, weights, chunk_rows=16, recompute=recompute, compiled=True)
        out.weighted_ce.backward()
        assert calls  # the plain objective on CUDA, compiled, takes the row pass
        results.append((out.weighted_ce.detach(), out.correct, out.per_block, h.grad.float()))
    (loss_a, correct_a, block_a, grad_a), (loss_b, correct_b, block_b, grad_b) = results
    assert torch.allclose(loss_a, loss_b, rtol=1e-4)
    assert torch.equal(correct_a, correct_b) and torch.equal(block_a, block_b)
    assert torch.allclose(grad_a, grad_b, rtol=1e-2, atol=1e-3)
    # a scaled objective (DFlash2's logits) keeps the compiled chunk
    calls.clear()
    block_loss(hidden, head, labels, weights, chunk_rows=16, compiled=True, logit_scale_and_cap=(2.0, None))
    assert not calls
