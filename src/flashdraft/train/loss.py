"""Gamma-weighted (or D-PACE-weighted) block cross-entropy through the frozen lm_head, with per-slot
accuracy and the training-time acceptance length (1 + correct slots before the first miss, per block).

Logits are computed chunk by chunk under activation checkpointing, so a 151,936-wide vocabulary
never materialises logits for all draft positions at once (forward or backward).

Hand-written rather than a fused linear cross-entropy kernel (liger-kernel, cut-cross-entropy)
because the step needs more than a reduced loss: a weight per position (slot decay x loss mask x
block validity) and each position's argmax (slot accuracy, tau_train, validation's walk), here
from the same chunk of logits. With `compiled`, torch.compile fuses what follows the lm_head matmul
(the fp32 upcast, log-softmax, the label's term, argmax, and in the backward softmax minus one-hot)
into a few passes over the bf16 logits. Eager, those element-wise kernels took 15 ms of the 232 ms
Qwen3-8B step on the H200 and the fp32 logits and log-softmax kept for the backward 10 GiB; compiled,
4 ms (`flashdraft bench --profile`, docs/results.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flashdraft.model.dflash2 import scale_and_cap


@dataclass
class BlockLoss:
    weighted_ce: torch.Tensor  # sum over positions of w * loss (CE, or CE and KL mixed; not normalised)
    correct: torch.Tensor  # [B] argmax hits per slot (label positions with loss mask only)
    counted: torch.Tensor  # [B] label positions per slot
    accepted: torch.Tensor  # sum over blocks of 1 + the run of correct slots from slot 1 on
    blocks: torch.Tensor  # blocks with at least one weighted label
    per_block: torch.Tensor | None = None  # [b * n] each block's acceptance length, 0 for an empty block

    @property
    def tau(self) -> torch.Tensor:
        """Acceptance length speculative decoding would see on these blocks (tau, docs/dflash.md)."""
        return self.accepted / self.blocks.clamp(min=1)


def _chunk_ce(
    h: torch.Tensor,
    w_head: torch.Tensor,
    labels: torch.Tensor,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
    scale: float = 1.0,
    softcap: float | None = None,
):
    """Per position: (1 - distill) x CE to the label + distill x KL(target || drafter), and the argmax.
    teacher: the target's final hidden state before each label (its next-token distribution there).
    scale, softcap: the drafter's logits are scale_and_cap(h @ w_head^T) (DFlash2)."""
    logits = scale_and_cap((h @ w_head.t()).float(), scale, softcap)
    loss = F.cross_entropy(logits, labels, reduction="none")
    if teacher is not None and distill > 0:
        with torch.no_grad():
            target_logp = F.log_softmax((teacher @ w_head.t()).float(), -1)
        kl = (target_logp.exp() * (target_logp - F.log_softmax(logits, -1))).sum(-1)
        loss = (1 - distill) * loss + distill * kl
    return loss, logits.argmax(-1)


_compiled_chunk_ce = torch.compile(_chunk_ce, dynamic=False)


def dpace_weights(ce: torch.Tensor, weights: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE slot weights [blocks, B-1] from each label's loss `ce` (no gradient) and the fixed
    `weights` (loss mask x validity x decay). The expected acceptance length of a block, with p_k the
    drafter's probability of label k and a label without weight ending the run as in decoding, is
    L = sum_k prod_{i<=k} p_i, and dL/dlog p_j = sum_{k>=j} prod_{i<=k} p_i: cross-entropy weighted so
    has L's gradient (negated). That alone (alpha = 0) puts the weight where the drafter is already
    right, whose cross-entropy has no gradient left: from a random start it trained nothing on
    SmolLM2 (docs/results.md). So, as D-PACE does, each p_k enters the products as the smoothed
    (1 - alpha) p_k + alpha, which keeps weight on the slots that end the runs. Scaled to the fixed
    weights' sum, so the step's normalisation holds."""
    live = weights > 0
    p = ((1 - alpha) * torch.exp(-ce) + alpha) * live
    run = torch.cumprod(p, dim=1)
    w = run.flip(1).cumsum(1).flip(1) * live
    return w * (weights.sum() / w.sum().clamp(min=1e-30))


def block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_rows: int = 8192,
    recompute: bool = True,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
    dpace: float | None = None,
    compiled: bool = False,
    logit_scale_and_cap: tuple[float, float | None] = (1.0, None),
) -> BlockLoss:
    """hidden [b, n*B, D] -> weighted CE over slots 1..B-1 (slot 0, the anchor, has no loss and
    no logits are computed for it).

    labels, weights: [b, n, B]; weights already include slot decay, loss mask and block validity.
    recompute: keep no logits for the backward (recompute each chunk's): less memory, one more
    lm_head matmul. teacher [b * n * (B-1), D], distill: soft-label distillation, the target's final
    hidden state before each label of slots 1..B-1; each position's loss is (1 - distill) x CE +
    distill x KL(target || drafter), the target's logits computed at those positions only.
    dpace: the weights' slot decay is replaced by `dpace_weights` with this smoothing alpha (the
    positions with a weight keep one); None: the fixed weights. compiled: each chunk's loss through
    torch.compile (module docstring). logit_scale_and_cap: the drafter's (DFlashDrafter's property).
    """
    b, n, bs = labels.shape
    h = hidden.view(b, n, bs, -1)[:, :, 1:].reshape(b * n * (bs - 1), -1)
    y = labels[:, :, 1:].reshape(-1)
    w = weights[:, :, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(bs, device=hidden.device)
    slot = torch.arange(1, bs, device=hidden.device).repeat(b * n)
    counted = torch.zeros(bs, device=hidden.device).index_add_(0, slot, (w > 0).float())
    hits = torch.empty_like(y, dtype=torch.bool)
    losses = []
    chunk_ce = _compiled_chunk_ce if compiled else _chunk_ce
    for start in range(0, h.shape[0], chunk_rows):
        sl = slice(start, start + chunk_rows)
        hc, yc, wc = h[sl], y[sl], w[sl]
        tc = teacher[sl] if teacher is not None else None
        if recompute and torch.is_grad_enabled() and hc.requires_grad:
            ce, pred = checkpoint(
                chunk_ce, hc, lm_head_weight, yc, tc, distill, *logit_scale_and_cap, use_reentrant=False
            )
        else:
            ce, pred = chunk_ce(hc, lm_head_weight, yc, tc, distill, *logit_scale_and_cap)
        if dpace is not None:
            losses.append(ce)
        else:
            total = total + (ce * wc).sum()
        hits[sl] = (pred == yc) & (wc > 0)
    if dpace is not None:
        ce = torch.cat(losses)
        w_dpace = dpace_weights(ce.detach().view(b * n, bs - 1), w.view(b * n, bs - 1), dpace)
        total = (ce * w_dpace.view(-1)).sum()
    correct.index_add_(0, slot, hits.float())
    # a masked label (no loss) ends the run: speculative decoding would stop at a turn's end too
    hits = hits.view(b * n, bs - 1)
    accepted = (1 + hits.cumprod(1).sum(1)).float()
    live = (w.view(b * n, bs - 1) > 0).any(1)
    per_block = accepted * live
    return BlockLoss(total, correct, counted, per_block.sum(), live.sum().float(), per_block)
