"""Landing anchors (`landing_anchors`): part of each row's blocks anchored where decoding would anchor
after the step's other blocks. That they are decoding's next anchors is in test_eval_spec.py."""

import pytest
import torch

from flashdraft.config import resolve_config
from flashdraft.train.blocks import Anchors, anchor_candidates, landing_anchors
from flashdraft.train.step import micro_step_loss
from flashdraft.train.timing import NULL_TIMER
from flashdraft.train.trainer import build_trainer


def test_landings_are_distinct_candidates_laid_out_as_anchors():
    block = 4
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1]])
    doc_ids = torch.tensor([[0] * 12 + [1] * 6])
    anchors = Anchors(torch.tensor([[1, 2, 4, 5, 6, 12, 0]]), torch.tensor([[1, 1, 1, 1, 1, 1, 0]]).bool())
    accepted = torch.tensor([[3, 2, 3, 5, 1, 2, 0]])  # 4, 4 (twice), 7, 10 (no loss), 7, 14, padding
    landed = landing_anchors(anchors, accepted, loss_mask, doc_ids, block, 5)
    assert landed.index.tolist() == [[4, 7, 14, 0, 0]] and landed.valid.tolist() == [[1, 1, 1, 0, 0]]
    cand = anchor_candidates(loss_mask, doc_ids, block)
    assert not cand[0, 10] and not cand[0, 15]  # a landing there would have no block
    # more landings than room: a seeded subset, the same for the same generator
    two = [landing_anchors(anchors, accepted, loss_mask, doc_ids, block, 2, torch.Generator().manual_seed(3))
           for _ in range(2)]  # fmt: skip
    assert two[0].index.tolist() == two[1].index.tolist() and set(two[0].index[0].tolist()) < {4, 7, 14}
    assert two[0].valid.all()


@pytest.fixture(scope="module")
def data_dir(token_data_dir):
    return token_data_dir


def _cfg(**over):
    base = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 4, "epochs": 2}
    base |= {"drafter.num_layers": 1, "drafter.num_taps": 2, "log_every": 2, "landing_anchors": 0.5}
    return resolve_config("default", **{**base, **over})


def test_a_run_trains_on_landing_blocks_and_resumes_to_the_same_weights(tmp_path, tiny_target_dir, data_dir):
    whole = build_trainer(_cfg(), tiny_target_dir, data_dir, tmp_path / "whole", device="cpu")
    assert (whole.spec.num_anchors, whole.spec.landing) == (4, 4)
    stats = whole.train_step()
    accepted, blocks = stats.landing
    assert blocks > 0 and "tau_landing" in stats.to_metrics()
    whole.run()
    sliced = build_trainer(_cfg(), tiny_target_dir, data_dir, tmp_path / "sliced", device="cpu")
    sliced.run(until=2)
    sliced.close()
    resumed = build_trainer(_cfg(), tiny_target_dir, data_dir, tmp_path / "sliced", device="cpu", resume=True)
    resumed.run()
    a, b = whole.drafter.state_dict(), resumed.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_step_is_the_anchor_weighted_mean_of_both_sets_of_blocks(tmp_path, tiny_target_dir, data_dir):
    """The gradient of a step with landing anchors, against a direct computation: the uniform blocks'
    loss over their weights x their share of the anchors, plus the landing blocks' likewise."""
    cfg = _cfg(grad_accum=2, **{"optim.grad_clip": 1e9})
    trainer = build_trainer(cfg, tiny_target_dir, data_dir, tmp_path / "run", device="cpu")
    params = dict(trainer.drafter.named_parameters())
    expected = {k: torch.zeros_like(v) for k, v in params.items()}
    first = [trainer._micro_batch(m, None, NULL_TIMER)[0] for m in trainer.micro_indices(1)]
    ws = sum(mb.blocks.weights.sum() for mb in first)
    for m, mb in zip(trainer.micro_indices(1), first, strict=True):
        out = micro_step_loss(trainer.drafter, trainer.target, mb, trainer.spec.kernels)
        walked = trainer.spec.plan_landing(mb, out, m)
        assert walked.features is mb.features and walked.anchors.valid.any()
        again = micro_step_loss(trainer.drafter, trainer.target, walked, trainer.spec.kernels)
        loss = 0.5 * out.weighted_ce / ws + 0.5 * again.weighted_ce / (2 * walked.blocks.weights.sum())
        for k, g in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
            expected[k] += g
    trainer.optimizer.step = lambda: None  # keep the step's gradients to read them
    trainer.optimizer.zero_grad = lambda set_to_none=True: None
    trainer.train_step()
    for k, p in params.items():
        torch.testing.assert_close(p.grad, expected[k], rtol=1e-4, atol=1e-7)
