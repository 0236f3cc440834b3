"""One training micro-step: target features -> blocks -> drafter forward -> weighted block loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.config import DFLASH2_SELECTOR_ALPHA, SelectorLossSpec
from flashdraft.data.packing import PackedBatch
from flashdraft.model.drafter import DFlashDrafter, Visibility
from flashdraft.model.target import Target
from flashdraft.train.blocks import (
    Anchors,
    Blocks,
    dense_visibility,
    every_anchor,
    flex_block_mask,
    make_blocks,
    row_generators,
    sample_anchors,
)
from flashdraft.train.loss import BlockLoss, SelectorObjective, block_loss
from flashdraft.train.timing import NULL_TIMER, PhaseTimer


@dataclass(frozen=True)
class Kernels:
    """Which kernels a forward runs, resolved once per run from the config and the device."""

    attention: str = "flex"  # flex (GPU) or dense (the SDPA reference; the CPU)
    compiled: bool = False  # the drafter's layers and the block mask compiled
    recompute_logits: bool = True  # the loss recomputes the lm_head logits in backward
    distill: float = 0.0  # the loss's weight of KL to the target's distribution (0: hard-label CE)
    dpace: float | None = None  # D-PACE's smoothing alpha (loss.dpace_weights); None: fixed slot decay
    selector: SelectorObjective | None = None  # how a DFlash2 drafter's selector trains; None: it does not


def selector_objective(spec: SelectorLossSpec, drafter: DFlashDrafter) -> SelectorObjective | None:
    """The selector's training term from the config's `selector` for this drafter: None for a DFlash
    drafter, which has no selector."""
    if drafter.dflash2 is None:
        if spec.alpha:
            raise ValueError(f"selector.alpha {spec.alpha}: a dflash drafter has no candidate selector")
        return None
    alpha = DFLASH2_SELECTOR_ALPHA if spec.alpha is None else spec.alpha
    return SelectorObjective(alpha, spec.warmup_steps, spec.ramp_steps, spec.gold, spec.stop_gradient)


@dataclass(frozen=True)
class StepSpec:
    """How every micro-batch of a run is made and computed: resolved once (config, device, drafter,
    world) and passed whole, instead of its fields one by one."""

    kernels: Kernels
    num_anchors: int
    block_size: int
    mask_token_id: int
    gamma: float
    anchors_per_document: int | None
    seed: int
    grad_accum: int
    num_drafters: int

    @property
    def micro_per_step(self) -> int:
        """Micro-batches of one optimizer step over every drafter rank."""
        return self.grad_accum * self.num_drafters

    def plan(
        self, batch: PackedBatch, m: int, features: torch.Tensor | None = None, teacher=None
    ) -> MicroBatch:
        """Global micro-batch m: its anchors (a pure function of the seed and m) and blocks."""
        rows = row_generators(self.seed, m, batch.input_ids.shape[0])
        mb = plan_micro_batch(
            batch, self.num_anchors, self.block_size, self.mask_token_id, self.gamma, rows, features,
            self.anchors_per_document,
        )  # fmt: skip
        mb.teacher = teacher
        return mb


@dataclass
class MicroBatch:
    batch: PackedBatch
    anchors: Anchors
    blocks: Blocks
    features: torch.Tensor | None = None  # tapped target features [b, S, N*D]
    teacher: torch.Tensor | None = None  # the target's final hidden state [b, S, D] (distillation)
    visibility: Visibility | dict[str, Visibility] | None = None  # built ahead (block_visibility)


def plan_micro_batch(
    batch: PackedBatch,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    generator: torch.Generator | list[torch.Generator],
    features: torch.Tensor | None = None,
    per_document: int | None = None,
) -> MicroBatch:
    anchors = sample_anchors(batch.loss_mask, batch.doc_ids, block_size, num_anchors, generator, per_document)
    return micro_batch_at(batch, anchors, block_size, mask_token_id, gamma, features)


def micro_batch_at(
    batch: PackedBatch,
    anchors: Anchors,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    features: torch.Tensor | None = None,
) -> MicroBatch:
    blocks = make_blocks(
        batch.input_ids, batch.loss_mask, batch.position_ids, anchors, block_size, mask_token_id, gamma
    )
    return MicroBatch(batch, anchors, blocks, features)


def acceptance_map(
    drafter: DFlashDrafter,
    target: Target,
    batch: PackedBatch,
    features: torch.Tensor,
    num_anchors: int,
    gamma: float,
    kernels: Kernels = Kernels(),
    on_pass=None,
) -> torch.Tensor:
    """[b, S]: the acceptance length of a block anchored at every anchor candidate (0 elsewhere), in
    passes of `num_anchors` blocks per row; `on_pass(mb, out)` sees each pass's micro-batch and loss."""
    b, s = batch.input_ids.shape
    accepted = torch.zeros(b, s, device=batch.input_ids.device)
    for anchors in every_anchor(batch.loss_mask, batch.doc_ids, drafter.block_size, num_anchors):
        mb = micro_batch_at(batch, anchors, drafter.block_size, drafter.mask_token_id, gamma, features)
        out = micro_step_loss(drafter, target, mb, kernels)
        # padding anchors sit at index 0 with length 0: adding them changes nothing
        accepted.scatter_add_(1, anchors.index, out.per_block.view(b, -1) * anchors.valid)
        if on_pass is not None:
            on_pass(mb, out)
    return accepted


def visibility_for(
    mb: MicroBatch, block_size: int, attention: str, compiled: bool, window: int | None = None
) -> Visibility | dict[str, Visibility]:
    """The block queries' visibility; with a sliding `window`, one per layer type."""

    def one(w: int | None) -> Visibility:
        if attention == "flex":
            b = mb.batch
            return Visibility(flex_block_mask(mb.anchors, b.doc_ids, block_size, compiled, w), compiled)
        return Visibility(dense_visibility(mb.anchors, mb.batch.doc_ids, block_size, w))

    if window is None:
        return one(None)
    return {"full_attention": one(None), "sliding_attention": one(window)}


def block_visibility(drafter: DFlashDrafter, mb: MicroBatch, kernels: Kernels) -> Visibility | dict:
    """The visibility `drafter` (or its DDP wrapper) gives mb's block queries under `kernels`."""
    window = getattr(drafter, "module", drafter).sliding_window
    return visibility_for(mb, mb.blocks.labels.shape[-1], kernels.attention, kernels.compiled, window)


def target_features(target: Target, batch: PackedBatch, plain_causal: bool = False, final: bool = False):
    """The target keeps the documents of a row apart by their position ids (`Target.packing`).
    plain_causal: every row is one document with no padding (checked on the host by the caller), so the
    target runs its plain causal kernel (flash), with no mask to build and no host sync. final: also its
    final hidden state (all layers run): (features, final)."""
    return target.features(batch.input_ids, None if plain_causal else batch.position_ids, final)


def teacher_rows(mb: MicroBatch) -> torch.Tensor:
    """[b * n * (B-1), D]: the target's final hidden state at the position before each label of slots
    1..B-1, in block_loss's row order (its next-token distribution for that label)."""
    b, n, bs = mb.blocks.labels.shape
    s, d = mb.teacher.shape[1], mb.teacher.shape[2]
    k = torch.arange(bs - 1, device=mb.teacher.device)  # slot k + 1's label follows position anchor + k
    idx = (mb.anchors.index[:, :, None] + k).clamp(max=s - 1).view(b, -1, 1).expand(-1, -1, d)
    return mb.teacher.gather(1, idx).reshape(-1, d)


def micro_step_loss(
    drafter: DFlashDrafter,
    target: Target,
    mb: MicroBatch,
    kernels: Kernels = Kernels(),
    timer: PhaseTimer = NULL_TIMER,
    step: int | None = None,
) -> BlockLoss:
    """Forward of one micro-batch; the caller normalises `weighted_ce` by the step's weight sum.

    Uses `mb.features` when a feature source already computed them (or received them from a
    target rank); otherwise runs the target here. Likewise `mb.visibility` (the block mask). `drafter`
    may be wrapped (DDP): only its forward is called. step: the optimizer step this micro-batch trains
    (1-based), which sets the selector term's weight (SelectorObjective.alpha_at); None outside training.
    """
    feats = mb.features
    if feats is None:
        with timer("target_forward"):
            feats = target_features(target, mb.batch)
    core = getattr(drafter, "module", drafter)  # a DDP wrapper holds the drafter as .module
    vis = mb.visibility
    if vis is None:
        with timer("block_mask"):
            vis = block_visibility(core, mb, kernels)
    with timer("drafter_forward"):
        with torch.no_grad():  # the block's input: the target's (frozen) token embeddings
            block_embeds = target.embed(mb.blocks.input_ids).to(feats.dtype)
        hidden = drafter(block_embeds, mb.blocks.positions, None, vis, feats, mb.batch.position_ids)
    with timer("loss_forward"):
        teacher = teacher_rows(mb) if mb.teacher is not None and kernels.distill > 0 else None
        objective = kernels.selector if core.dflash2 is not None else None
        return block_loss(
            hidden,
            target.lm_head.weight,
            mb.blocks.labels,
            mb.blocks.weights,
            recompute=kernels.recompute_logits,
            teacher=teacher,
            distill=kernels.distill,
            dpace=kernels.dpace,
            compiled=kernels.compiled,
            logit_scale_and_cap=core.logit_scale_and_cap,
            selector=core.candidate_selector if objective is not None else None,
            selector_objective=objective,
            selector_alpha=objective.alpha_at(step) if objective is not None else 0.0,
        )
