"""DFlash training semantics (docs/dflash.md): anchors, visibility, labels, loss weights.

A packed batch row holds whole documents: input_ids, loss_mask, position_ids (restarting at 0 in
every document) and doc_ids (-1 on padding), all [b, S]. For each row we sample anchors; block j
is [token at anchor_j, MASK x (B-1)] at positions pos(anchor_j) + 0..B-1, and slot k predicts the
token at anchor_j + k. Attention keys are laid out as [context (S) | block_0 | ... | block_{n-1}].

Visibility is written twice on purpose: `flex_mask_mod` for flex_attention (the fast path) and
`dense_visibility` as a plain construction from the rules (the reference path, tested against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

# gamma of the slot weights exp(-(k-1)/gamma) by block size (docs/dflash.md, training semantics).
GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}

_compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)


def default_gamma(block_size: int) -> float:
    if block_size not in GAMMA_BY_BLOCK:
        known = sorted(GAMMA_BY_BLOCK)
        raise ValueError(f"no published gamma for block size {block_size} (known: {known}); set gamma")
    return GAMMA_BY_BLOCK[block_size]


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1, and 0 for slot 0 (the anchor is not predicted)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    # not `w[0] = 0.0`: on the GPU that assignment copies a host scalar and waits for the queued work
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), 0.0)


@dataclass
class Anchors:
    index: torch.Tensor  # [b, n] row index of each anchor (0 where invalid), sorted within a row
    valid: torch.Tensor  # [b, n] bool: False marks a padding block


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, S] bool: loss_mask = 1 at the anchor and the whole block stays inside its document."""
    b, s = loss_mask.shape
    last = torch.arange(s, device=loss_mask.device) + block_size - 1
    fits = last < s
    end_doc = doc_ids.gather(1, last.clamp(max=s - 1).expand(b, s))
    return (loss_mask > 0) & fits & (end_doc == doc_ids) & (doc_ids >= 0)


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | list[torch.Generator] | None = None,
    per_document: int | None = None,
) -> Anchors:
    """Up to `num_anchors` distinct candidate positions per row, uniformly at random, sorted.

    Rows with fewer candidates get padding blocks (valid False, index 0). `generator` may be one
    CPU generator for the batch or one per row (then a row's anchors do not depend on its batch).
    per_document: at most this many anchors in any one packed document (the budget a document
    would have had alone), so a long document does not take a row's whole budget.
    """
    cand = anchor_candidates(loss_mask, doc_ids, block_size)
    b, s = cand.shape
    n = min(num_anchors, s)
    # Drawn on CPU generators, so a run's anchors do not depend on the device.
    if isinstance(generator, list):
        scores = torch.cat([torch.rand(1, s, generator=g) for g in generator])
    else:
        scores = torch.rand(b, s, generator=generator)
    # non_blocking: a blocking copy to the GPU would wait for the target's forward queued before it,
    # leaving the GPU idle while the host then builds the block mask (5 ms a step, bench --profile)
    scores = scores.to(cand.device, non_blocking=True).masked_fill(~cand, 2.0)
    if per_document is not None:
        scores = scores.masked_fill(_rank_in_document(scores, doc_ids) >= per_document, 2.0)
    chosen_scores, idx = scores.topk(n, dim=1, largest=False)
    valid = chosen_scores < 2.0
    idx = idx.masked_fill(~valid, s)
    idx, order = idx.sort(dim=1)
    valid = valid.gather(1, order)
    idx = idx.masked_fill(~valid, 0)
    if num_anchors > n:  # more anchors asked than positions: pad to the fixed anchor count
        pad = num_anchors - n
        idx = torch.cat([idx, idx.new_zeros(b, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(b, pad)], 1)
    return Anchors(idx, valid)


def every_anchor(
    loss_mask: torch.Tensor, doc_ids: torch.Tensor, block_size: int, num_anchors: int
) -> list[Anchors]:
    """Every anchor candidate of every row, in passes of `num_anchors` per row (the fixed shape a
    compiled training step has), each pass laid out as `sample_anchors` lays its anchors out."""
    cand = anchor_candidates(loss_mask, doc_ids, block_size)
    b, s = cand.shape
    positions = torch.arange(s, device=cand.device).expand(b, s)
    idx = positions.masked_fill(~cand, s).sort(dim=1).values  # candidates first, in order
    passes = max(1, -(-int(cand.sum(1).max()) // num_anchors))
    idx = torch.cat([idx, idx.new_full((b, max(0, passes * num_anchors - s)), s)], 1)
    out = []
    for k in range(passes):
        chunk = idx[:, k * num_anchors : (k + 1) * num_anchors]
        valid = chunk < s
        out.append(Anchors(chunk.masked_fill(~valid, 0), valid))
    return out


def walk_lengths(accepted: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> list[list[int]]:
    """The acceptance lengths greedy speculative decoding would see, read off teacher-forced blocks.

    accepted [b, S]: the acceptance length of the block anchored at each position (0 where none was
    measured). Decoding a document's answer anchors its first block at the answer's first token and
    each next block where the last one's acceptance ended, so it visits the hard spots more often than
    anchors spread evenly do: tau over these cycles is the served tau, tau over all anchors is higher.
    The walk ends where blocks stop fitting in the document (its last B - 1 tokens). One list per
    document with an answer (its first assistant turn), on the host."""
    walks = []
    for acc, mask, docs in zip(accepted.tolist(), loss_mask.tolist(), doc_ids.tolist(), strict=True):
        starts = {}  # document -> the first token of its first answer
        for p, (m, d) in enumerate(zip(mask, docs, strict=True)):
            if m > 0 and d >= 0 and d not in starts:
                starts[d] = p
        for d, p in starts.items():
            lengths = []
            while p < len(acc) and docs[p] == d and acc[p] > 0:
                lengths.append(int(acc[p]))
                p += lengths[-1]
            if lengths:
                walks.append(lengths)
    return walks


def _rank_in_document(scores: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, S]: how many positions of the same document have a lower score (0 = the document's best)."""
    order = scores.argsort(dim=1)
    docs = doc_ids.gather(1, order).clamp(min=0)
    onehot = torch.nn.functional.one_hot(docs, int(docs.max()) + 1)
    rank_sorted = ((onehot.cumsum(1) - 1) * onehot).sum(-1)
    return torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)


def row_generators(seed: int, micro_index: int, rows: int) -> list[torch.Generator]:
    """Anchor RNG of each row of global micro-batch `micro_index`: a pure function of the run seed
    and the row's place in the data stream, so anchors are the same whatever the number of ranks,
    the layout, or a resume (nothing to save), and differ every epoch."""
    base = (seed * 1_000_003 + micro_index) * 4099
    return [torch.Generator().manual_seed((base + r) % (2**63)) for r in range(rows)]


@dataclass
class Blocks:
    """Everything the drafter and the loss need about the blocks of a batch."""

    input_ids: torch.Tensor  # [b, n*B] block tokens: anchor token then MASK
    positions: torch.Tensor  # [b, n*B] absolute positions
    labels: torch.Tensor  # [b, n, B] token at anchor + k
    weights: torch.Tensor  # [b, n, B] w_k * loss_mask(label) * valid, 0 at slot 0


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor,
    anchors: Anchors,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    b, s = input_ids.shape
    n = anchors.index.shape[1]
    k = torch.arange(block_size, device=input_ids.device)
    label_idx = (anchors.index[:, :, None] + k).clamp(max=s - 1)  # [b, n, B]
    flat = label_idx.view(b, -1)
    labels = input_ids.gather(1, flat).view(b, n, block_size)
    label_mask = loss_mask.gather(1, flat).view(b, n, block_size).float()
    w = slot_weights(block_size, gamma, device=input_ids.device)
    weights = w * label_mask * anchors.valid[:, :, None].float()
    block_ids = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    block_ids[:, :, 0] = labels[:, :, 0]
    positions = position_ids.gather(1, anchors.index)[:, :, None] + k
    return Blocks(block_ids.view(b, -1), positions.view(b, -1), labels, weights)


def flex_mask_mod(anchors: Anchors, doc_ids: torch.Tensor, block_size: int, window: int | None = None):
    """mask_mod for flex_attention over keys [context (S) | blocks (n*B)].

    window: a sliding-window layer, as the z-lab format and the reference package define one: causal
    (block slot q sees its own block's slots 0..q) and a key at most window - 1 positions before the
    query (query at anchor + q).

    Every query sees two contiguous ranges of keys, one of the context and one of its own block
    (`visible_ranges`): the mask_mod compares the key with the query's four bounds, read once per query
    row of a tile, where a rule written out per key would also read each key's document."""
    ctx_lo, ctx_hi, own_lo, own_hi = visible_ranges(anchors, doc_ids, block_size, window)

    def mask_mod(b, h, q_idx, kv_idx):
        in_ctx = (kv_idx >= ctx_lo[b, q_idx]) & (kv_idx < ctx_hi[b, q_idx])
        return in_ctx | ((kv_idx >= own_lo[b, q_idx]) & (kv_idx < own_hi[b, q_idx]))

    return mask_mod


def visible_ranges(
    anchors: Anchors, doc_ids: torch.Tensor, block_size: int, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys each query of [b, n*B] sees, as two half-open ranges (int32 [b, n*B] each): of the context,
    [its document's start, the anchor), cut to the window; and of its own block, the whole block, or its
    slots up to itself within the window. A padding block's ranges are empty. Documents lie whole and
    contiguous in a row, as packing lays them."""
    b, s = doc_ids.shape
    n = anchors.index.shape[1]
    a = anchors.index[:, :, None]  # [b, n, 1]
    slot = torch.arange(block_size, device=doc_ids.device)  # [B]
    first = s + torch.arange(n, device=doc_ids.device)[:, None] * block_size  # [n, 1]: a block's first key
    ctx_lo, ctx_hi = document_starts(doc_ids).gather(1, anchors.index)[:, :, None], a
    own_lo, own_hi = first, first + block_size
    if window is not None:
        ctx_lo = torch.maximum(ctx_lo, a + slot - window + 1)
        own_lo, own_hi = first + (slot - window + 1).clamp(min=0), first + slot + 1
    ctx_lo, ctx_hi, own_lo, own_hi = torch.broadcast_tensors(ctx_lo, ctx_hi, own_lo, own_hi, slot)[:4]
    valid = anchors.valid[:, :, None]
    ranges = [torch.where(valid, x, 0) for x in (ctx_lo, ctx_hi, own_lo, own_hi)]
    return tuple(x.reshape(b, n * block_size).to(torch.int32) for x in ranges)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, S]: where each position's document starts (documents lie whole and contiguous in a row)."""
    pos = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.cummax(torch.where(new_doc, pos, 0), dim=1).values


def structured_block_mask(
    anchors: Anchors,
    doc_ids: torch.Tensor,
    block_size: int,
    tile: int = 128,
    window: int | None = None,
) -> BlockMask:
    """The BlockMask of `flex_mask_mod`, built straight from the block structure with a few tensor
    ops instead of evaluating the mask_mod everywhere.

    Why by hand: `torch.compile(create_block_mask)` took 231 s to compile on a cold cache on the
    H200 (and eager evaluation over 8192 x 11264 positions costs more than the attention), while
    the structure is simple: draft block j sees the keys [doc_start(anchor_j), anchor_j) of the
    context, one contiguous range, and its own block. Needs tile % block_size == 0 and
    S % tile == 0 == n*B % tile (flex_block_mask checks and otherwise uses create_block_mask).
    With a sliding `window` the context range starts window - 1 before the anchor at the earliest, and
    every tile with a visible key is partial (the mask_mod decides within it: the range moves with the
    slot, and the own block is causal).
    """
    b, s = doc_ids.shape
    n = anchors.index.shape[1]
    group = tile // block_size  # draft blocks per query tile
    q_tiles, c_tiles = n // group, s // tile
    a = anchors.index
    lo = document_starts(doc_ids).gather(1, a)  # the anchor's document starts here
    if window is not None:
        lo = torch.maximum(lo, a - window + 1)
    hi = torch.where(anchors.valid, a, lo)  # a padding block sees nothing
    starts = torch.arange(c_tiles, device=a.device) * tile
    seen = (torch.minimum(hi[..., None], starts + tile) - torch.maximum(lo[..., None], starts)).clamp(min=0)
    seen = seen.view(b, q_tiles, group, c_tiles)
    full_ctx = (seen == tile).all(dim=2)
    part_ctx = (seen > 0).any(dim=2) & ~full_ctx
    any_valid = anchors.valid.view(b, q_tiles, group).any(dim=2)
    own = torch.eye(q_tiles, dtype=torch.bool, device=a.device) & any_valid[..., None]
    no_own = torch.zeros_like(own)
    own_full = group == 1 and block_size == tile and window is None
    if window is not None:
        part_ctx, full_ctx = part_ctx | full_ctx, torch.zeros_like(full_ctx)
    partial = torch.cat([part_ctx, no_own if own_full else own], dim=2)[:, None]
    full = torch.cat([full_ctx, own if own_full else no_own], dim=2)[:, None]

    def indices(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
        return m.sum(-1, dtype=torch.int32), order.to(torch.int32)

    # the backward's view, each key tile's query tiles, from the same tiles (BlockMask.from_kv_blocks
    # would rebuild them from the indices under two vmaps: half the mask's host time)
    by_q = (*indices(partial), *indices(full))
    by_kv = (*indices(partial.transpose(-2, -1)), *indices(full.transpose(-2, -1)))
    mask_mod = flex_mask_mod(anchors, doc_ids, block_size, window)
    return BlockMask((n * block_size, s + n * block_size), *by_q, *by_kv, (tile, tile), mask_mod)


def fits_structured(seq_len: int, num_blocks: int, block_size: int, tile: int = 128) -> bool:
    return tile % block_size == 0 and seq_len % tile == 0 and (num_blocks * block_size) % tile == 0


def flex_block_mask(
    anchors: Anchors,
    doc_ids: torch.Tensor,
    block_size: int,
    compiled: bool,
    window: int | None = None,
) -> BlockMask:
    if fits_structured(doc_ids.shape[1], anchors.index.shape[1], block_size):
        return structured_block_mask(anchors, doc_ids, block_size, window=window)
    b, s = doc_ids.shape
    q_len = anchors.index.shape[1] * block_size
    build = _compiled_create_block_mask if compiled else create_block_mask
    return build(
        flex_mask_mod(anchors, doc_ids, block_size, window),
        B=b,
        H=None,
        Q_LEN=q_len,
        KV_LEN=s + q_len,
        device=doc_ids.device,
    )


def dense_visibility(
    anchors: Anchors, doc_ids: torch.Tensor, block_size: int, window: int | None = None
) -> torch.Tensor:
    """Reference: bool [b, 1, n*B, S + n*B], built block by block from the rules (`flex_mask_mod`)."""
    b, s = doc_ids.shape
    n = anchors.index.shape[1]
    q_len = n * block_size
    mask = torch.zeros(b, 1, q_len, s + q_len, dtype=torch.bool, device=doc_ids.device)
    for r in range(b):
        for j in range(n):
            if not anchors.valid[r, j]:
                continue
            a = int(anchors.index[r, j])
            rows = slice(j * block_size, (j + 1) * block_size)
            same_doc_before = doc_ids[r, :a] == doc_ids[r, a]  # strictly before the anchor
            mask[r, 0, rows, :a] = same_doc_before
            mask[r, 0, rows, s + j * block_size : s + (j + 1) * block_size] = True
            if window is not None:
                for q in range(block_size):  # the query at a + q: keys after a + q - window, causal
                    row = mask[r, 0, j * block_size + q]
                    row[: max(0, a + q - window + 1)] = False
                    own = s + j * block_size
                    row[own + q + 1 : own + block_size] = False
                    row[own : own + max(0, q - window + 1)] = False
    return mask
