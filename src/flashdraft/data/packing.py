"""Token shards -> packed fixed-shape training rows.

A token dataset directory (written by `flashdraft data prepare` and the demo) holds
DIR/shards: a `datasets` dataset (Arrow, memory-mapped) with columns input_ids (list of int)
and loss_mask (list of 0/1), plus DIR/stats.json. Training packs whole documents, in a seeded
per-epoch order, into rows of exactly `seq_len` tokens so shapes never change; a document longer
than a row is truncated to it. Each row carries position ids restarting at 0 per document and
document ids (-1 on padding) so the block mask and the target keep documents apart.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SHARDS = "shards"


def load_token_dataset(data_dir: str | Path):
    import datasets

    path = Path(data_dir) / SHARDS
    if not path.is_dir():
        raise FileNotFoundError(f"{data_dir}: no token shards at {path} (run `flashdraft data prepare`)")
    ds = datasets.load_from_disk(str(path))
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    return ds


def save_token_dataset(records: Sequence[dict], data_dir: str | Path) -> Path:
    """Write documents {input_ids, loss_mask[, id]} as DIR/shards."""
    import datasets

    path = Path(data_dir) / SHARDS
    datasets.Dataset.from_list(list(records)).save_to_disk(str(path))
    return path


def pack_documents(lengths: Sequence[int], seq_len: int, order: Sequence[int]) -> list[list[int]]:
    """Greedy in order: append each document to the current row while it fits, else open a new row.

    Documents are never split; one longer than `seq_len` gets a row to itself (and is truncated).
    """
    rows: list[list[int]] = []
    used = seq_len
    for i in order:
        n = min(int(lengths[i]), seq_len)
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(int(i))
        used += n
    return rows


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [b, S]
    loss_mask: torch.Tensor  # [b, S]
    position_ids: torch.Tensor  # [b, S]
    doc_ids: torch.Tensor  # [b, S], -1 on padding

    def to(self, device) -> PackedBatch:
        return PackedBatch(*(t.to(device, non_blocking=True) for t in vars(self).values()))

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())

    @property
    def plain_causal(self) -> bool:
        """Every row holds one document and no padding: plain causal attention is exact."""
        return bool((self.doc_ids == 0).all())


def collate_rows(docs_per_row: Sequence[Sequence[dict]], seq_len: int, pad_token_id: int) -> PackedBatch:
    b = len(docs_per_row)
    ids = torch.full((b, seq_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros(b, seq_len, dtype=torch.long)
    pos = torch.zeros(b, seq_len, dtype=torch.long)
    doc = torch.full((b, seq_len), -1, dtype=torch.long)
    for r, docs in enumerate(docs_per_row):
        at = 0
        for d, rec in enumerate(docs):
            n = min(len(rec["input_ids"]), seq_len - at)
            ids[r, at : at + n] = torch.as_tensor(rec["input_ids"][:n])
            mask[r, at : at + n] = torch.as_tensor(rec["loss_mask"][:n])
            pos[r, at : at + n] = torch.arange(n)
            doc[r, at : at + n] = d
            at += n
    return PackedBatch(ids, mask, pos, doc)


class PackedLoader:
    """Epochs of packed batches in a seeded order; (epoch, batch index) is the whole position."""

    def __init__(self, dataset, seq_len: int, rows_per_batch: int, pad_token_id: int, seed: int):
        self.ds = dataset
        self.seq_len = seq_len
        self.rows_per_batch = rows_per_batch
        self.pad_token_id = pad_token_id
        self.seed = seed
        if "length" in dataset.column_names:
            self.lengths = list(dataset["length"])
        else:
            self.lengths = [len(x) for x in dataset["input_ids"]]

    @functools.lru_cache(maxsize=2)  # noqa: B019 (one loader per run; the plan of an epoch is reused)
    def rows(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        return pack_documents(self.lengths, self.seq_len, order)

    def batches_in_epoch(self, epoch: int) -> int:
        """Full batches of an epoch (a last partial batch is dropped)."""
        return len(self.rows(epoch)) // self.rows_per_batch

    def batch(self, epoch: int, index: int) -> PackedBatch:
        rows = self.rows(epoch)[index * self.rows_per_batch : (index + 1) * self.rows_per_batch]
        docs = [[self.ds[j] for j in row] for row in rows]
        return collate_rows(docs, self.seq_len, self.pad_token_id)


class MicroBatchStream:
    """The run's data as one sequence of micro-batches over epochs: global index m -> batch.

    Every rank computes the same sequence; rank r trains on its share of indices (see the trainer),
    and a resumed run needs nothing but the step to find its place.
    """

    def __init__(self, loader: PackedLoader, epochs: int):
        self.loader = loader
        self.epochs = epochs
        self._per_epoch: list[int] = []

    def _counts(self, upto_epoch: int) -> list[int]:
        while len(self._per_epoch) <= upto_epoch:
            self._per_epoch.append(self.loader.batches_in_epoch(len(self._per_epoch)))
        return self._per_epoch

    def __len__(self) -> int:
        """Micro-batches in `epochs` epochs."""
        return sum(self._counts(self.epochs - 1)[: self.epochs])

    def locate(self, m: int) -> tuple[int, int]:
        """(epoch, batch index) of global micro-batch m; past the last epoch the data repeats."""
        epoch = 0
        while True:
            count = self._counts(epoch)[epoch]
            if count == 0:
                raise ValueError("an epoch has no full batch: too little data for rows_per_batch")
            if m < count:
                return epoch, m
            m -= count
            epoch += 1

    def __getitem__(self, m: int) -> PackedBatch:
        return self.loader.batch(*self.locate(m))
