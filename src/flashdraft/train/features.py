"""Where a drafter rank's micro-batches and target features come from: `LocalFeatures` runs this
rank's target on the batches of the stream (the colocated layout), `ReceivedFeatures` takes both from a
target rank (a drafter rank of a split layout; flashdraft.distributed.exchange). Either gives the step
(batch on the device, features, the target's final hidden state when the loss distills, context
tokens) for global micro-batch m."""

from __future__ import annotations

import torch

from flashdraft.distributed.exchange import RemoteFeatures
from flashdraft.model.target import Target
from flashdraft.train.step import target_features
from flashdraft.train.timing import PhaseTimer


class LocalFeatures:
    """stream: the run's micro-batches by global index (a MicroBatchStream); final: the loss distills,
    so the target runs every layer and gives its final hidden state too."""

    def __init__(self, stream, target: Target, device: torch.device, final: bool):
        self.stream, self.target, self.device, self.final = stream, target, device, final

    def get(self, m: int, next_m: int | None, timer: PhaseTimer):
        with timer("data"):
            cpu = self.stream[m]
            batch = cpu.to(self.device)
        with timer("target_forward"):
            if self.final:
                feats, teacher = target_features(self.target, batch, cpu.plain_causal, final=True)
            else:
                feats, teacher = target_features(self.target, batch, cpu.plain_causal), None
        return batch, feats, teacher, cpu.num_tokens


class ReceivedFeatures:
    def __init__(self, remote: RemoteFeatures):
        self.remote = remote

    def get(self, m: int, next_m: int | None, timer: PhaseTimer):
        with timer("receive"):
            batch, feats = self.remote.get(m, next_m)
        return batch, feats, None, (batch.doc_ids >= 0).sum()  # on the device: no sync in the step
