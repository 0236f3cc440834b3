"""Soft-label distillation (`distill`): the loss at each label is (1 - distill) x CE + distill x KL from
the target's next-token distribution there, computed from the target's final hidden state at the
position before the label and its lm_head, at label positions only."""

import torch
import torch.nn.functional as F

from flashdraft.train.loss import block_loss
from flashdraft.train.step import Kernels, micro_step_loss, plan_micro_batch, target_features, teacher_rows
from helpers import BLOCK, GAMMA, MASK_ID, packed_batch, target_and_drafter


def test_the_kl_term_equals_a_direct_computation_and_vanishes_when_the_drafter_is_the_target():
    g = torch.Generator().manual_seed(0)
    b, n, bs, d, vocab = 2, 3, 4, 8, 11
    hidden = torch.randn(b, n * bs, d, generator=g)
    teacher = torch.randn(b * n * (bs - 1), d, generator=g)
    head = torch.randn(vocab, d, generator=g)
    labels = torch.randint(0, vocab, (b, n, bs), generator=g)
    weights = torch.rand(b, n, bs, generator=g)
    student = hidden.view(b, n, bs, d)[:, :, 1:].reshape(-1, d)
    w = weights[:, :, 1:].reshape(-1)
    p_t = F.softmax(teacher @ head.t(), -1)
    kl = (p_t * (p_t.log() - F.log_softmax(student @ head.t(), -1))).sum(-1)
    ce = F.cross_entropy(student @ head.t(), labels[:, :, 1:].reshape(-1), reduction="none")
    for alpha in (0.0, 0.3, 1.0):
        out = block_loss(hidden, head, labels, weights, chunk_rows=5, teacher=teacher, distill=alpha)
        expected = (w * ((1 - alpha) * ce + alpha * kl)).sum()
        torch.testing.assert_close(out.weighted_ce, expected, rtol=1e-5, atol=1e-5)
    same = block_loss(hidden, head, labels, weights, teacher=student.clone(), distill=1.0)
    assert abs(float(same.weighted_ce)) < 1e-5  # the drafter's distribution is the target's


def test_the_teacher_is_the_targets_final_state_just_before_each_label():
    """Slot k's label sits at anchor + k; the target's distribution for it is read at anchor + k - 1."""
    target, drafter = target_and_drafter()
    batch = packed_batch([[60, 60], [120]], seq_len=128)
    feats, final = target_features(target, batch, final=True)
    assert torch.equal(feats, target_features(target, batch))  # the same taps, every layer run
    with torch.no_grad():
        ids, pos = batch.input_ids, batch.position_ids  # no cache: transformers keeps the documents apart
        whole = target.model(ids, position_ids=pos, use_cache=False, output_hidden_states=True)
    torch.testing.assert_close(final, whole.hidden_states[-1])  # the normed last layer, as the lm_head reads
    torch.testing.assert_close(target.lm_head(final), whole.logits)
    mb = plan_micro_batch(batch, 4, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0), feats)
    mb.teacher = final
    rows = teacher_rows(mb).view(2, 4, BLOCK - 1, -1)
    for r in range(2):
        for j in range(4):
            for k in range(1, BLOCK):
                at = min(int(mb.anchors.index[r, j]) + k - 1, 127)
                assert torch.equal(rows[r, j, k - 1], final[r, at])
    plain = micro_step_loss(drafter, target, mb, Kernels("dense"))
    mixed = micro_step_loss(drafter, target, mb, Kernels("dense", distill=0.5))
    assert not torch.isclose(plain.weighted_ce, mixed.weighted_ce)
    mb.teacher = None  # without the target's final state the loss is CE, whatever distill says
    unchanged = micro_step_loss(drafter, target, mb, Kernels("dense", distill=0.5))
    torch.testing.assert_close(unchanged.weighted_ce, plain.weighted_ce)


def test_a_run_distills_colocated_and_the_config_refuses_it_split(tmp_path, tiny_target_dir, tiny_tokenizer):
    import pytest

    from flashdraft.config import resolve_config, resolve_run_config
    from flashdraft.data.packing import save_token_dataset
    from flashdraft.train.build import build_trainer
    from helpers import random_docs

    docs = random_docs([70, 90, 120, 60] * 2, seed=9, prompt_len=10)
    for d in docs:
        d["input_ids"] = [i % len(tiny_tokenizer) for i in d["input_ids"]]
    save_token_dataset(docs, tmp_path / "data")
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 2}
    losses = {}
    for alpha in (0.0, 0.5):
        cfg = resolve_config("tiny_cpu", **over, distill=alpha)
        trainer = build_trainer(cfg, tiny_target_dir, tmp_path / "data", tmp_path / f"r{alpha}", "cpu")
        stats = trainer.train_step()
        losses[alpha] = float(stats.loss_sum / stats.weight_sum)
        assert trainer.run().final_loss > 0
    assert losses[0.0] != losses[0.5]  # the same first batch, another loss
    run = {"run.target": "t", "run.data": "d", "run.out": "o", "run.layout": "split:1:1"}
    with pytest.raises(ValueError, match="distill needs the target's final hidden state"):
        resolve_run_config("tiny_cpu", **run, distill=0.5)
