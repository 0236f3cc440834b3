"""The block loss through torch.compile (`compiled`, on by default on the GPU) computes what the eager loss
does: the weighted loss, the per-slot hits and tau, and the gradient the drafter receives."""

import pytest
import torch

from flashdraft.train.loss import block_loss

pytestmark = pytest.mark.slow  # inductor compiles on the CPU


@pytest.mark.parametrize("recompute", [False, True])
def test_the_compiled_loss_equals_the_eager_loss_and_its_gradient(recompute):
    g = torch.Generator().manual_seed(0)
    b, n, bs, d, vocab = 2, 6, 4, 16, 97  # 36 label rows: chunks of 16, 16 and 4 (two shapes)
    head = torch.randn(vocab, d, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (b, n, bs), generator=g)
    labels[0, 0, 1:] = (torch.randn(1, d, generator=g) @ head.float().t()).argmax()  # some hits
    weights = torch.rand(b, n, bs, generator=g) * (torch.rand(b, n, bs, generator=g) > 0.2)
    base = torch.randn(b, n * bs, d, generator=g).to(torch.bfloat16)
    runs = {}
    for compiled in (False, True):
        for dpace in (None, 0.5):
            hidden = base.clone().requires_grad_()
            out = block_loss(
                hidden,
                head,
                labels,
                weights,
                chunk_rows=16,
                recompute=recompute,
                dpace=dpace,
                compiled=compiled,
            )
            out.weighted_ce.backward()
            runs[compiled, dpace] = (out, hidden.grad)
    for dpace in (None, 0.5):
        (eager, eager_grad), (fused, fused_grad) = runs[False, dpace], runs[True, dpace]
        torch.testing.assert_close(fused.weighted_ce, eager.weighted_ce, rtol=1e-5, atol=1e-5)
        assert torch.equal(fused.correct, eager.correct) and torch.equal(fused.per_block, eager.per_block)
        assert eager_grad.abs().sum() > 0
        torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-2, atol=1e-3)
