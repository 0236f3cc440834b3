"""The training semantics of docs/dflash.md: anchors, visibility, labels, weights."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from flashdraft.model.drafter import default_target_layer_ids
from flashdraft.train.blocks import (
    Anchors,
    anchor_candidates,
    default_gamma,
    dense_visibility,
    every_anchor,
    flex_mask_mod,
    make_blocks,
    sample_anchors,
    slot_weights,
    structured_block_mask,
    walk_lengths,
)
from helpers import BLOCK, GAMMA, MASK_ID, packed_batch


def test_default_target_layer_ids_follow_the_published_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(28, 3) == [1, 13, 25]
    with pytest.raises(ValueError, match=r"distinct .*\(drafter.num_taps\).*\(drafter.target_layer_ids\)"):
        default_target_layer_ids(4, 3)


def test_gamma_by_block_size():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    with pytest.raises(ValueError, match="gamma"):
        default_gamma(12)


def test_anchors_are_sorted_distinct_candidates_with_padding_blocks():
    batch = packed_batch([[30, 40], [20]], seq_len=96)
    g = torch.Generator().manual_seed(0)
    anchors = sample_anchors(batch.loss_mask, batch.doc_ids, BLOCK, 40, g)
    cand = anchor_candidates(batch.loss_mask, batch.doc_ids, BLOCK)
    for r in range(2):
        idx = anchors.index[r][anchors.valid[r]]
        n_cand = int(cand[r].sum())
        assert len(idx) == min(40, n_cand)
        assert torch.all(idx[1:] > idx[:-1])  # sorted and distinct
        assert bool(cand[r, idx].all())
        # every block lies inside its document and is loss-masked at the anchor
        for a in idx.tolist():
            assert batch.loss_mask[r, a] == 1
            assert a + BLOCK - 1 < 96
            assert batch.doc_ids[r, a + BLOCK - 1] == batch.doc_ids[r, a]
        assert not anchors.valid[r, len(idx) :].any()  # the rest are padding blocks
    # row 1 has one 20-token doc: loss positions 4..19, anchors need a + 7 <= 19 -> 4..12
    assert int(cand[1].sum()) == 9


def test_every_anchor_visits_each_candidate_once_in_fixed_size_passes():
    batch = packed_batch([[30, 40], [20]], seq_len=96)
    cand = anchor_candidates(batch.loss_mask, batch.doc_ids, BLOCK)
    passes = every_anchor(batch.loss_mask, batch.doc_ids, BLOCK, 16)
    assert len(passes) == -(-int(cand.sum(1).max()) // 16) > 1
    for r in range(2):
        seen = torch.cat([p.index[r][p.valid[r]] for p in passes])
        assert seen.tolist() == torch.nonzero(cand[r]).flatten().tolist()  # each once, in order
    for p in passes:
        assert p.index.shape == (2, 16)  # the compiled step's shape
        for r in range(2):  # valid anchors first, padding after, as sample_anchors lays them out
            v = p.valid[r]
            assert not (~v[:-1] & v[1:]).any() and not p.index[r][~v].any()


def test_the_walk_anchors_each_block_where_the_last_acceptance_ended():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1]])
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1]])
    accepted = torch.tensor([[0, 0, 3, 9, 9, 2, 9, 1, 0, 0, 0, 4, 9, 0]])
    # document 0: answer from 2; cycles at 2 (3), 5 (2), 7 (1), then 8 has no block: the walk ends
    # document 1: answer from 11; 4 reaches past the document, so one cycle
    assert walk_lengths(accepted, loss_mask, doc_ids) == [[3, 2, 1], [4]]


def test_anchors_resample_with_the_generator():
    batch = packed_batch([[60]], seq_len=64)
    a = sample_anchors(batch.loss_mask, batch.doc_ids, BLOCK, 8, torch.Generator().manual_seed(1))
    b = sample_anchors(batch.loss_mask, batch.doc_ids, BLOCK, 8, torch.Generator().manual_seed(2))
    assert not torch.equal(a.index, b.index)


def _anchors_near_the_end(batch, n: int) -> Anchors:
    """Random anchors per row, including the last valid one near the sequence end, plus padding."""
    cand = anchor_candidates(batch.loss_mask, batch.doc_ids, BLOCK)
    idx, valid = [], []
    for r in range(cand.shape[0]):
        pos = cand[r].nonzero().flatten()
        pick = torch.cat([pos[torch.randperm(len(pos))[: n - 2]], pos[-1:]]).unique().sort().values
        pad = n - len(pick)
        idx.append(torch.cat([pick, torch.zeros(pad, dtype=torch.long)]))
        valid.append(torch.cat([torch.ones(len(pick), dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)]))
    return Anchors(torch.stack(idx), torch.stack(valid))


@pytest.mark.parametrize("window", [None, 5, 12])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flex_mask_equals_dense_reference_element_for_element(seed, window):
    torch.manual_seed(seed)
    batch = packed_batch([[30, 50, 16], [100], [40]], seq_len=128, seed=seed)
    anchors = _anchors_near_the_end(batch, n=6)
    s, n = 128, 6
    mod = flex_mask_mod(anchors, batch.doc_ids, BLOCK, window)
    flex = create_mask(mod, 3, None, n * BLOCK, s + n * BLOCK, "cpu")
    dense = dense_visibility(anchors, batch.doc_ids, BLOCK, window)
    assert torch.equal(flex, dense)


def test_a_sliding_window_layer_sees_its_window_causally():
    """As the reference package's sliding layers: the query at anchor + q sees keys at positions
    anchor + q - window + 1 .. anchor + q, its own block causally."""
    batch = packed_batch([[64]], seq_len=64)
    anchors = Anchors(torch.tensor([[30]]), torch.tensor([[True]]))
    m = dense_visibility(anchors, batch.doc_ids, BLOCK, window=4)[0, 0]
    for q in range(BLOCK):
        seen = [k for k in range(64) if m[q, k]] + [30 + t for t in range(BLOCK) if m[q, 64 + t]]
        assert seen == list(range(30 + q - 3, 30 + q + 1)), q


def test_dense_reference_encodes_the_visibility_rules():
    batch = packed_batch([[20, 30]], seq_len=64)
    anchors = Anchors(torch.tensor([[25, 10, 0]]), torch.tensor([[True, True, False]]))
    m = dense_visibility(anchors, batch.doc_ids, BLOCK)[0, 0]
    s = 64
    block0 = m[0:BLOCK]
    # anchor 25 is in doc 1 (rows 20..49): context 20..24 visible, 25 (the anchor) and doc 0 not
    assert block0[:, 20:25].all() and not block0[:, 25:s].any() and not block0[:, :20].any()
    assert block0[:, s : s + BLOCK].all()  # own block, bidirectional
    assert not block0[:, s + BLOCK :].any()  # no other block
    block1 = m[BLOCK : 2 * BLOCK]
    assert block1[:, :10].all() and not block1[:, 10:s].any()
    assert not m[2 * BLOCK :].any()  # padding block sees nothing


def test_same_position_labels_and_decayed_weights():
    seq = 64
    batch = packed_batch([[seq]], seq_len=seq)
    batch.input_ids = torch.arange(seq)[None]  # token id == position, so labels name their position
    anchors = Anchors(torch.tensor([[4, 30, 0]]), torch.tensor([[True, True, False]]))
    blocks = make_blocks(batch.input_ids, batch.loss_mask, batch.position_ids, anchors, BLOCK, MASK_ID, GAMMA)
    for j, a in enumerate([4, 30]):
        assert blocks.labels[0, j].tolist() == list(range(a, a + BLOCK))  # slot k -> anchor + k
        assert blocks.input_ids[0, j * BLOCK] == a  # slot 0 holds the anchor token
        assert (blocks.input_ids[0, j * BLOCK + 1 : (j + 1) * BLOCK] == MASK_ID).all()
        assert blocks.positions[0, j * BLOCK : (j + 1) * BLOCK].tolist() == list(range(a, a + BLOCK))
        w = blocks.weights[0, j]
        assert w[0] == 0  # the anchor slot carries no loss
        expected = [math.exp(-(k - 1) / GAMMA) for k in range(1, BLOCK)]
        assert w[1:].tolist() == pytest.approx(expected)
    assert (blocks.weights[0, 2] == 0).all()  # padding block


def test_weights_follow_the_loss_mask_at_the_label_position():
    batch = packed_batch([[40]], seq_len=40)
    batch.loss_mask[0, 12] = 0
    anchors = Anchors(torch.tensor([[8]]), torch.tensor([[True]]))
    blocks = make_blocks(batch.input_ids, batch.loss_mask, batch.position_ids, anchors, BLOCK, MASK_ID, GAMMA)
    assert blocks.weights[0, 0, 4] == 0  # label position 8 + 4 = 12 is masked
    assert blocks.weights[0, 0, 3] > 0


def test_slot_weights():
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1.0 and w[15] == pytest.approx(math.exp(-2.0))


@pytest.mark.parametrize("seed,tile", [(0, 128), (1, 128), (0, 64)])
def test_structured_block_mask_equals_create_block_mask(seed, tile):
    """The hand-built BlockMask has the same partial and full tiles as flex's own builder, seen from the
    queries (the forward) and from the keys (the backward)."""
    from torch.nn.attention.flex_attention import _transpose_ordered, create_block_mask

    torch.manual_seed(seed)
    batch = packed_batch([[300, 150, 62], [512], [100, 200]], seq_len=512, seed=seed)
    anchors = _anchors_near_the_end(batch, n=32)  # 32 x 8 = 256 query rows = 2 tiles
    # one document: whole context tiles visible, and an anchor one short of a tile's end (127)
    anchors.index[1] = torch.cat([torch.tensor([127]), torch.arange(260, 260 + 31 * 7, 7)])
    anchors.valid[1] = True
    mine = structured_block_mask(anchors, batch.doc_ids, BLOCK, tile=tile)
    mod = flex_mask_mod(anchors, batch.doc_ids, BLOCK)
    ref = create_block_mask(mod, 3, None, 32 * BLOCK, 512 + 32 * BLOCK, device="cpu", BLOCK_SIZE=tile)

    def tiles(num, idx):
        return [[set(idx[r, 0, q, : num[r, 0, q]].tolist()) for q in range(num.shape[2])] for r in range(3)]

    assert tiles(mine.kv_num_blocks, mine.kv_indices) == tiles(ref.kv_num_blocks, ref.kv_indices)
    assert tiles(mine.full_kv_num_blocks, mine.full_kv_indices) == tiles(
        ref.full_kv_num_blocks, ref.full_kv_indices
    )
    assert any(any(row) for row in tiles(mine.full_kv_num_blocks, mine.full_kv_indices))  # full tiles exist
    # the backward's view, each key tile's query tiles: flex's own builder's, and exactly flex's transpose
    # of the forward's view (the order of the indices included)
    assert tiles(mine.q_num_blocks, mine.q_indices) == tiles(ref.q_num_blocks, ref.q_indices)
    assert tiles(mine.full_q_num_blocks, mine.full_q_indices) == tiles(
        ref.full_q_num_blocks, ref.full_q_indices
    )
    for kv, q in (
        ((mine.kv_num_blocks, mine.kv_indices), (mine.q_num_blocks, mine.q_indices)),
        (
            (mine.full_kv_num_blocks, mine.full_kv_indices),
            (mine.full_q_num_blocks, mine.full_q_indices),
        ),
    ):
        for got, want in zip(q, _transpose_ordered(*kv), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("window", [5, 200])
def test_a_sliding_structured_mask_attends_as_create_block_mask(window):
    """With a window every visible tile is partial (the mask_mod decides inside): the tiles differ from
    flex's own builder, the attention they give does not."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    batch = packed_batch([[300, 150, 62], [512], [100, 200]], seq_len=512, seed=0)
    anchors = _anchors_near_the_end(batch, n=32)
    mine = structured_block_mask(anchors, batch.doc_ids, BLOCK, window=window)
    mod = flex_mask_mod(anchors, batch.doc_ids, BLOCK, window)
    ref = create_block_mask(mod, 3, None, 32 * BLOCK, 512 + 32 * BLOCK, device="cpu")
    q = torch.randn(3, 2, 32 * BLOCK, 16)
    k, v = torch.randn(2, 3, 2, 512 + 32 * BLOCK, 16)
    valid = anchors.valid.repeat_interleave(BLOCK, 1)[:, None, :, None]  # padding blocks see nothing
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=mine) * valid,
                               flex_attention(q, k, v, block_mask=ref) * valid)  # fmt: skip


def test_the_anchor_budget_is_per_document():
    batch = packed_batch([[200, 40, 40]], seq_len=280)
    g = torch.Generator().manual_seed(0)
    capped = sample_anchors(batch.loss_mask, batch.doc_ids, BLOCK, 40, g, per_document=6)
    docs = batch.doc_ids[0, capped.index[0][capped.valid[0]]]
    counts = torch.bincount(docs, minlength=3).tolist()
    assert counts == [6, 6, 6]  # each document its own budget, the long one no more
    uncapped = sample_anchors(batch.loss_mask, batch.doc_ids, BLOCK, 40, torch.Generator().manual_seed(0))
    assert torch.bincount(batch.doc_ids[0, uncapped.index[0][uncapped.valid[0]]])[0] > 6


def test_packing_keeps_documents_whole_and_in_order():
    from flashdraft.data.packing import pack_documents

    lengths = [50, 100, 30, 200, 300, 10, 128]
    rows = pack_documents(lengths, 256, order=list(range(7)))
    assert sorted(i for row in rows for i in row) == list(range(7))  # every document exactly once
    assert all(sum(min(lengths[i], 256) for i in row) <= 256 for row in rows)  # never split: it fits
    assert rows == [[0, 1, 2], [3], [4], [5, 6]]
    batch = packed_batch([[50, 100, 30]], seq_len=256)
    assert batch.doc_ids[0, :180].unique().tolist() == [0, 1, 2] and (batch.doc_ids[0, 180:] == -1).all()
    assert batch.position_ids[0, 50] == 0 and batch.position_ids[0, 149] == 99  # positions restart


def test_loader_batches_lay_documents_end_to_end_as_a_token_loop_would(tmp_path):
    """The loader's vectorised collation against the plain per-document loop it replaced."""
    from flashdraft.data.packing import (
        MicroBatchStream,
        PackedLoader,
        load_token_dataset,
        save_token_dataset,
    )

    g = torch.Generator().manual_seed(0)
    lengths = [5, 64, 17, 90, 3, 40, 33, 8, 71, 26, 12, 50]  # 90 and 71 are longer than a row
    docs = [
        {"input_ids": torch.randint(1, 100, (n,), generator=g).tolist(),
         "loss_mask": torch.randint(0, 2, (n,), generator=g).tolist()}
        for n in lengths
    ]  # fmt: skip
    save_token_dataset(docs, tmp_path)
    loader = PackedLoader(load_token_dataset(tmp_path), seq_len=64, rows_per_batch=2, pad_token_id=0, seed=3)
    stream = MicroBatchStream(loader, epochs=2)
    for m in range(len(stream)):
        epoch, index = stream.locate(m)
        rows = loader.rows(epoch)[index * 2 : index * 2 + 2]
        got = stream[m]
        for r, row in enumerate(rows):
            ids, mask, pos, doc = [], [], [], []
            for d, j in enumerate(row):
                n = min(lengths[j], 64 - len(ids))
                ids += docs[j]["input_ids"][:n]
                mask += docs[j]["loss_mask"][:n]
                pos += list(range(n))
                doc += [d] * n
            pad = 64 - len(ids)
            assert got.input_ids[r].tolist() == ids + [0] * pad
            assert got.loss_mask[r].tolist() == mask + [0] * pad
            assert got.position_ids[r].tolist() == pos + [0] * pad
            assert got.doc_ids[r].tolist() == doc + [-1] * pad


def test_a_stream_packs_only_the_epochs_a_count_up_to_a_limit_needs(tmp_path):
    """`upto(limit)` is min(len, limit) without packing every epoch (a run of 100 epochs whose length
    max_steps sets packed them all at each start: 36 s); a stored `length` column gives the lengths."""
    from flashdraft.data.packing import MicroBatchStream, PackedLoader, load_token_dataset, save_token_dataset

    lengths = [5, 64, 17, 90, 3, 40, 33, 8, 71, 26, 12, 50]
    docs = [{"input_ids": [1] * n, "loss_mask": [1] * n, "length": n} for n in lengths]
    save_token_dataset(docs, tmp_path)
    loader = PackedLoader(load_token_dataset(tmp_path), seq_len=64, rows_per_batch=2, pad_token_id=0, seed=3)
    assert loader.lengths == lengths
    stream = MicroBatchStream(loader, epochs=50)
    first = loader.batches_in_epoch(0)
    assert stream.upto(first) == first and len(stream._per_epoch) == 1
    assert stream.upto(first + 1) == first + 1 and len(stream._per_epoch) == 2
    whole = len(MicroBatchStream(loader, epochs=50))
    assert stream.upto(10**9) == whole and len(stream._per_epoch) == 50


def test_training_tau_counts_correct_slots_up_to_the_first_miss():
    """Block 4 (slots 1..3 have labels); logits = hidden through an identity lm_head, so hits are chosen."""
    from flashdraft.train.loss import block_loss

    vocab, bs = 8, 4
    labels = torch.tensor([[[0, 1, 2, 3], [0, 4, 5, 6], [0, 1, 1, 1], [0, 2, 2, 2]]])
    predicted = torch.tensor([[[0, 1, 2, 3], [0, 4, 0, 6], [0, 0, 1, 1], [0, 2, 2, 2]]])
    weights = torch.ones(1, 4, bs)
    weights[0, 3] = 0  # a padding block: not counted
    weights[0, 0, 3] = 0  # a masked label ends the run, as a turn's end stops decoding
    hidden = torch.nn.functional.one_hot(predicted, vocab).float().view(1, 4 * bs, vocab)
    out = block_loss(hidden, torch.eye(vocab), labels, weights)
    # block 0: slots 1, 2 hit, slot 3 masked -> 3; block 1: slot 1 hits, slot 2 misses -> 2;
    # block 2: slot 1 misses -> 1 (later hits do not count)
    assert out.blocks.item() == 3
    assert out.accepted.item() == 3 + 2 + 1
    assert out.tau.item() == pytest.approx(2.0)
    assert out.correct.tolist() == [0, 2, 2, 2]
