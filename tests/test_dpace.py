"""D-PACE slot weights (`position_weights: dpace`): unsmoothed, the weighted cross-entropy has the
gradient of the expected acceptance length; smoothed, it keeps its weight where the drafter is wrong;
a run trains with them."""

import pytest
import torch
import torch.nn.functional as F

from flashdraft.train.loss import block_loss, dpace_weights


def _blocks(seed: int = 0, b: int = 2, n: int = 3, bs: int = 5, d: int = 8, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n * bs, d, generator=g, requires_grad=True)
    head = torch.randn(vocab, d, generator=g)
    labels = torch.randint(0, vocab, (b, n, bs), generator=g)
    weights = torch.rand(b, n, bs, generator=g)
    weights[0, 1, 3] = 0  # a masked label ends its block's run
    weights[1, 2] = 0  # an empty block
    return hidden, head, labels, weights


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_the_weights_are_each_slots_share_of_the_expected_acceptance_length(alpha):
    ce = torch.tensor([[0.1, 0.5, 2.0], [0.3, 0.2, 0.4]])
    fixed = torch.tensor([[1.0, 0.5, 0.25], [1.0, 0.0, 0.25]])  # block 2's run ends at its slot 2
    w = dpace_weights(ce, fixed, alpha)
    p = (1 - alpha) * torch.exp(-ce) + alpha
    direct = torch.tensor(
        [
            [
                p[0, 0] + p[0, 0] * p[0, 1] + p[0, :].prod(),
                p[0, 0] * p[0, 1] + p[0, :].prod(),
                p[0, :].prod(),
            ],
            [p[1, 0], 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(w, direct * fixed.sum() / direct.sum())
    assert w[0, 0] > w[0, 1] > w[0, 2] > 0  # earlier slots count in more of the runs


def test_smoothed_weights_stay_where_the_drafter_is_wrong():
    """Unsmoothed, a block the drafter already gets right takes all the weight and the loss vanishes
    (what a run from a random start did on SmolLM2); smoothed, the blocks it gets wrong keep theirs."""
    ce = torch.full((4, 15), 11.0)  # p ~ 2e-5: a drafter that knows nothing yet
    ce[0] = 1e-4  # except one block it already gets right
    fixed = torch.ones_like(ce)
    for alpha, low, high in ((0.0, 0, 1e-4), (0.5, 0.05, 1)):
        w = dpace_weights(ce, fixed, alpha)
        assert low < w[1, 0] / w[0, 0] < high  # a wrong block's first slot against the right block's
        assert low < (ce * w).sum() / (ce * fixed).sum() < high  # the loss, against the fixed weights'


def test_the_unsmoothed_dpace_loss_has_the_gradient_of_the_expected_acceptance_length():
    hidden, head, labels, weights = _blocks()
    out = block_loss(hidden, head, labels, weights, chunk_rows=7, dpace=0.0)  # chunks across blocks
    (grad,) = torch.autograd.grad(out.weighted_ce, hidden)

    b, n, bs = labels.shape
    h = hidden.view(b, n, bs, -1)[:, :, 1:]
    logp = F.log_softmax(h @ head.t(), -1).gather(-1, labels[:, :, 1:, None]).squeeze(-1)
    live = weights[:, :, 1:] > 0
    p = logp.exp() * live
    expected_length = torch.cumprod(p, dim=-1).sum()  # sum over blocks of sum_k prod_{i<=k} p_i
    (surrogate,) = torch.autograd.grad(expected_length, hidden)
    with torch.no_grad():
        runs = torch.cumprod(p, -1).flip(-1).cumsum(-1).flip(-1) * live
        scale = weights[:, :, 1:].sum() / runs.sum()
    torch.testing.assert_close(grad, -scale * surrogate)
    # the statistics are the gamma loss's
    gamma = block_loss(hidden, head, labels, weights, chunk_rows=7)
    assert torch.equal(out.correct, gamma.correct) and torch.equal(out.accepted, gamma.accepted)
    assert not torch.allclose(out.weighted_ce, gamma.weighted_ce)


def test_a_run_trains_with_dpace_weights(tmp_path, tiny_target_dir):
    from flashdraft.config import resolve_config
    from flashdraft.data.packing import save_token_dataset
    from flashdraft.train.build import build_trainer
    from helpers import random_docs

    data = tmp_path / "data"
    save_token_dataset(random_docs([70, 90, 120, 60, 100, 80] * 2, seed=3, prompt_len=10), data)
    losses = {}
    for kind in ("gamma", "dpace"):
        cfg = resolve_config(
            "tiny_cpu", position_weights=kind, max_steps=3, **{"drafter.num_layers": 1, "data.seq_len": 128}
        )
        trainer = build_trainer(cfg, tiny_target_dir, data, tmp_path / kind, device="cpu")
        assert trainer.spec.kernels.dpace == (0.5 if kind == "dpace" else None)
        result = trainer.run()
        losses[kind] = (result.first_loss, result.final_loss)
        trainer.close()
    assert all(map(torch.isfinite, map(torch.tensor, losses["dpace"])))
    assert losses["dpace"][0] != pytest.approx(losses["gamma"][0])  # another weighting of the same step
