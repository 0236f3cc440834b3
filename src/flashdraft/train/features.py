"""Where a drafter rank's micro-batches and target features come from: `LocalFeatures` runs this
rank's target on the batches of the stream (the colocated layout), `ReceivedFeatures` takes both from a
target rank (a drafter rank of a split layout; flashdraft.distributed.exchange). Either gives the step
(batch on the device, features, the target's final hidden state when the loss distills, context
tokens) for global micro-batch m."""

from __future__ import annotations

from flashdraft.train.step import target_features
from flashdraft.train.timing import PhaseTimer


class LocalFeatures:
    def __init__(self, trainer):
        self.trainer = trainer  # its stream is read at every batch (a caller may swap it)

    def get(self, m: int, next_m: int | None, timer: PhaseTimer):
        t = self.trainer
        with timer("data"):
            cpu = t.stream[m]
            batch = cpu.to(t.device)
        with timer("target_forward"):
            if t.spec.kernels.distill > 0:  # every layer, and the final hidden state for the loss
                feats, teacher = target_features(t.target, batch, cpu.plain_causal, final=True)
            else:
                feats, teacher = target_features(t.target, batch, cpu.plain_causal), None
        return batch, feats, teacher, cpu.num_tokens


class ReceivedFeatures:
    def __init__(self, remote):
        self.remote = remote

    def get(self, m: int, next_m: int | None, timer: PhaseTimer):
        with timer("receive"):
            batch, feats = self.remote.get(m, next_m)
        return batch, feats, None, (batch.doc_ids >= 0).sum()  # on the device: no sync in the step
