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
4 ms (`flashdraft bench --profile`, docs/results.md). Compiled on CUDA, the plain objective (no
distillation, scale, cap or top-k) takes flashdraft.train.row_ce's Triton kernels instead, which read
the logits once forward and write their gradient over them backward.

A DFlash2 drafter adds its candidate selector's term (`selector_loss`): each chunk also returns its
logits' top-k, so the term is computed afterwards on [positions, k] tensors and no [positions, vocab]
tensor outlives its chunk.

When the selector's term stops at its own parameters (the default), the top-k and the label's logit
are taken without gradient: with one, the backward put their (zero) gradients back into two
[positions, vocab] float32 tensors per chunk (a scatter each, then a sum), 5 GB each at Qwen3-8B's
151,936-wide vocabulary and 8,192 positions a chunk. A chunk recomputed for the backward
(`recompute_logits`) computes only what carries a gradient: no argmax, and no top-k without one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flashdraft.model.dflash2 import CandidateSelector, scale_and_cap

# BlockLoss.selector's sums, in order: the base loss (weighted, without the selector's term); the
# selector's cross-entropy and the weight it was counted with; label positions whose label is among
# the top-k; the selector's teacher-forced hits; the acceptance length of its path summed over blocks
SELECTOR_SUMS = (
    "base_ce", "selector_ce", "selector_weight", "recalled", "selector_correct", "selector_accepted"
)  # fmt: skip


@dataclass(frozen=True)
class SelectorObjective:
    """How DFlash2's candidate selector trains beside the base loss (docs/dflash.md, DFlash2): the
    cross-entropy of its scores over each draft position's top-k candidates, with the true previous
    token as predecessor (teacher forcing) and the label as the class, times `alpha`. alpha is 0 for
    the first `warmup_steps` optimizer steps, then rises linearly to its value over `ramp_steps`.
    gold: where the label is not among the top-k, `inject` puts it in the lowest candidate's place (in
    the loss only); `skip` leaves the position out. stop_gradient: the term reaches the selector's own
    parameters only, not the logits or the drafter's hidden states."""

    alpha: float
    warmup_steps: int = 0
    ramp_steps: int = 0
    gold: Literal["inject", "skip"] = "skip"
    stop_gradient: bool = True

    def alpha_at(self, step: int | None) -> float:
        """The term's weight at optimizer step `step` (1-based); None, outside training: alpha."""
        if step is None:
            return self.alpha
        ramped = step - self.warmup_steps
        if ramped <= 0:
            return 0.0
        return self.alpha * min(1.0, ramped / self.ramp_steps) if self.ramp_steps else self.alpha


class SelectorRows(NamedTuple):
    """Per draft position: the selector's loss, the weight it counts with, whether the label is among
    the top-k, whether the selector's pick (teacher-forced, from the top-k as served) is the label."""

    ce: torch.Tensor
    weight: torch.Tensor
    recalled: torch.Tensor
    hits: torch.Tensor


@dataclass
class BlockLoss:
    weighted_ce: torch.Tensor  # what backward takes: sum over positions of w * loss (CE, or CE and KL
    # mixed), plus alpha x the selector's weighted CE for DFlash2; not normalised
    correct: torch.Tensor  # [B] argmax hits per slot (label positions with loss mask only)
    counted: torch.Tensor  # [B] label positions per slot
    accepted: torch.Tensor  # sum over blocks of 1 + the run of correct slots from slot 1 on
    blocks: torch.Tensor  # blocks with at least one weighted label
    # [b * n] each block's acceptance length as T = 0 decoding drafts (the argmax; DFlash2: the selector's
    # path), 0 for an empty block
    per_block: torch.Tensor | None = None
    selector: torch.Tensor | None = None  # DFlash2: the sums SELECTOR_SUMS names, without gradient
    selector_alpha: float | None = None  # DFlash2: the selector term's weight in weighted_ce

    @property
    def tau(self) -> torch.Tensor:
        """Acceptance length speculative decoding would see on these blocks (tau, docs/dflash.md)."""
        return self.accepted / self.blocks.clamp(min=1)


def top_k_by_blocks(x: torch.Tensor, k: int, max_block: int = 256) -> torch.return_types.topk:
    """x.topk(k, dim=-1) for x [rows, width], the values sorted, by way of blocks of the last axis: each
    block's maximum, the k blocks with the largest, then the top-k of those blocks' entries. Exact: an
    entry among the k largest lies in a block whose maximum is at least its value, and fewer than k blocks
    can have a larger one. Only which of equal entries comes back may differ from torch.topk's.

    Why: torch.topk over rows as wide as a vocabulary was most of what DFlash2 added to the step. On an
    H200 the loss forward of a DFlash2 step went from 94.8 to 36.6 ms at Gemma 3's 262,144 tokens (DFlash's:
    28.8) and from 51.5 to 39.3 ms at Qwen3-8B's shape (docs/results.md, DFlash2). The block is the largest
    power of two up to `max_block` that divides the width (256 for Gemma 3's and Llama 3's vocabularies,
    128 for Qwen3's); a width with fewer than 32 channels to a block, or with at most 4k blocks, takes
    torch.topk as it is."""
    rows, width = x.shape
    block = min(max_block, width & -width)  # the largest power of two dividing the width
    if block < 32 or width // block <= 4 * k:
        return x.topk(k, dim=-1)
    chosen = x.view(rows, width // block, block).amax(-1).topk(k, dim=-1).indices  # [rows, k]
    index = (chosen[..., None] * block + torch.arange(block, device=x.device)).flatten(1)  # [rows, k * block]
    top = x.gather(-1, index).topk(k, dim=-1)
    return torch.return_types.topk((top.values, index.gather(-1, top.indices)))


def _chunk_ce(
    h: torch.Tensor,
    w_head: torch.Tensor,
    labels: torch.Tensor,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
    scale: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
    top_grad: bool = False,
):
    """Per position: (1 - distill) x CE to the label + distill x KL(target || drafter), and the argmax.
    teacher: the target's final hidden state before each label (its next-token distribution there).
    scale, softcap: the drafter's logits are scale_and_cap(h @ w_head^T) (DFlash2). top_k > 0: also the
    top-k logits and their tokens [rows, k] and the label's logit [rows] (the selector's unary scores),
    with a gradient when `top_grad`. In a checkpoint's recompute (`_recomputing`) only the loss, and the
    top-k when it has a gradient: the rest has none and comes from the forward."""
    raw = h @ w_head.t()
    logits = scale_and_cap(raw.float(), scale, softcap)
    loss = F.cross_entropy(logits, labels, reduction="none")
    if teacher is not None and distill > 0:
        with torch.no_grad():
            target_logp = F.log_softmax((teacher @ w_head.t()).float(), -1)
        kl = (target_logp.exp() * (target_logp - F.log_softmax(logits, -1))).sum(-1)
        loss = (1 - distill) * loss + distill * kl
    if _recomputing and not (top_k and top_grad):
        return (loss,)
    pred = None
    if not _recomputing:
        with torch.no_grad():
            pred = logits.argmax(-1)
    if top_k:
        with torch.no_grad():  # the cast is exact and scale_and_cap increasing: the logits' order, read
            index = top_k_by_blocks(raw, top_k).indices  # where the matmul wrote it, no fp32 copy
        with torch.set_grad_enabled(top_grad and torch.is_grad_enabled()):
            values = logits.gather(-1, index)
            label_logit = logits.gather(-1, labels[:, None])[:, 0]
        return loss, pred, values, index, label_logit
    return loss, pred


_compiled_chunk_ce = torch.compile(_chunk_ce, dynamic=False)


def _row_chunk_ce(h: torch.Tensor, w_head: torch.Tensor, labels: torch.Tensor, *_):
    """_chunk_ce for the plain objective (no teacher, scale or cap, top-k) through flashdraft.train.row_ce's
    one-read Triton pass over the chunk's logits."""
    from flashdraft.train.row_ce import linear_cross_entropy  # Triton: imported on CUDA only

    loss, pred = linear_cross_entropy(h, w_head, labels)
    return (loss,) if _recomputing else (loss, pred)


_recomputing = False  # True while a checkpoint recomputes a chunk for the backward


@contextlib.contextmanager
def _recompute():
    global _recomputing
    _recomputing = True
    try:
        yield
    finally:
        _recomputing = False


def _recompute_contexts():
    """torch.utils.checkpoint's context_fn: the forward as it is, the recompute flagged."""
    return contextlib.nullcontext(), _recompute()


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


def selector_loss(
    selector: CandidateSelector,
    h: torch.Tensor,
    unary: torch.Tensor,
    candidates: torch.Tensor,
    label_logit: torch.Tensor,
    labels: torch.Tensor,
    previous: torch.Tensor,
    weights: torch.Tensor,
    gold: Literal["inject", "skip"],
    stop_gradient: bool = True,
) -> SelectorRows:
    """The selector's teacher-forced cross-entropy at each draft position (SelectorObjective).

    h [rows, D] the drafter's hidden states; unary, candidates [rows, k] the top-k logits (sorted, the
    best first) and their tokens; label_logit [rows] the label's logit; labels, previous [rows] the label
    and the true token before it; weights [rows] the base loss's fixed weights. A candidate scores as
    CandidateSelector.select scores it: its logit plus the pairwise score given the previous token."""
    if stop_gradient:
        h, unary, label_logit = h.detach(), unary.detach(), label_logit.detach()
    gate = selector.hidden_projection(h)
    scores = unary + selector.pairwise(gate, previous, candidates)  # what decoding chooses from
    is_label = candidates == labels[:, None]
    recalled = is_label.any(-1)
    target = is_label.int().argmax(-1)
    if gold == "inject":
        label_score = label_logit + selector.pairwise(gate, previous, labels[:, None])[:, 0]
        lowest = torch.where(recalled, scores[:, -1], label_score)
        trained = torch.cat([scores[:, :-1], lowest[:, None]], dim=-1)
        target = torch.where(recalled, target, scores.shape[-1] - 1)
        weight = weights
    else:
        trained, weight = scores, weights * recalled
    ce = F.cross_entropy(trained.float(), target, reduction="none")
    pick = candidates.gather(-1, scores.detach().argmax(-1, keepdim=True))[:, 0]
    live = weights > 0
    return SelectorRows(ce, weight, recalled & live, (pick == labels) & live)


def acceptance_lengths(hits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[blocks] 1 + the run of hits from slot 1 on, 0 for a block without a weighted label; hits and
    weights [blocks, B-1]. A masked label (no loss) ends the run: decoding would stop at a turn's end."""
    accepted = (1 + hits.cumprod(1).sum(1)).float()
    return accepted * (weights > 0).any(1)


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
    selector: CandidateSelector | None = None,
    selector_objective: SelectorObjective | None = None,
    selector_alpha: float = 0.0,
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
    torch.compile, or row_ce's kernel (module docstring). logit_scale_and_cap: the drafter's
    (DFlashDrafter's property).
    selector, selector_objective: a DFlash2 drafter's candidate selector and how it trains; its term,
    times `selector_alpha`, joins weighted_ce (with the fixed weights, whatever `dpace` says).
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
    losses, tops = [], []
    top_k = selector.top_k if selector is not None else 0
    chunk_ce = _compiled_chunk_ce if compiled else _chunk_ce
    plain = not (teacher is not None and distill > 0) and logit_scale_and_cap == (1.0, None) and not top_k
    if compiled and plain and hidden.is_cuda:
        chunk_ce = _row_chunk_ce
    objective = selector_objective or SelectorObjective(selector_alpha)
    top_grad = bool(top_k) and not objective.stop_gradient
    for start in range(0, h.shape[0], chunk_rows):
        sl = slice(start, start + chunk_rows)
        hc, yc, wc = h[sl], y[sl], w[sl]
        tc = teacher[sl] if teacher is not None else None
        args = (hc, lm_head_weight, yc, tc, distill, *logit_scale_and_cap, top_k, top_grad)
        if recompute and torch.is_grad_enabled() and hc.requires_grad:
            ce, pred, *top = checkpoint(chunk_ce, *args, use_reentrant=False, context_fn=_recompute_contexts)
        else:
            ce, pred, *top = chunk_ce(*args)
        tops.append(top)
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
    per_block = acceptance_lengths(hits.view(b * n, bs - 1), w.view(b * n, bs - 1))
    out = BlockLoss(total, correct, counted, per_block.sum(), (per_block > 0).sum().float(), per_block)
    if selector is None:
        return out
    unary, candidates, label_logit = (torch.cat(parts) for parts in zip(*tops, strict=True))
    previous = labels[:, :, :-1].reshape(-1)  # slot 1's is the anchor token (labels' slot 0)
    rows = selector_loss(
        selector, h, unary, candidates, label_logit, y, previous, w, objective.gold, objective.stop_gradient
    )
    weighted = (rows.ce * rows.weight).sum()
    # the selector's greedy path walked on its own picks: while they are right its previous token is the
    # true one, so up to its first miss it picks as teacher-forced: its run is that of the hits
    accepted = acceptance_lengths(rows.hits.view(b * n, bs - 1), w.view(b * n, bs - 1))
    sums = [total, weighted, rows.weight.sum(), rows.recalled.sum(), rows.hits.sum(), accepted.sum()]
    out.selector = torch.stack([x.detach().float() for x in sums])
    out.per_block = accepted  # DFlash2 decodes its selector's path: the walk validation takes (val_tau_walk)
    out.selector_alpha = selector_alpha
    out.weighted_ce = total + selector_alpha * weighted
    return out
