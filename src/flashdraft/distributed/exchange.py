"""Split layout: target ranks send features to drafter ranks over point-to-point messages.

A message is two fixed-size tensors, so nothing is re-shaped between steps: a header (int64: input
ids, loss mask, position ids, document ids of the packed rows, then the sender's busy fraction in
parts per million) and the tapped features (the target's dtype). Both sides allocate their
message buffers once and reuse them in turn. A target rank keeps at most three sends in flight in
three buffers: it fills buffer n % 3 only after the send of message n - 3 completed, so computing
the next micro-batch overlaps sending the last two. A drafter rank receives into grad_accum + 1
buffers: a step takes all its grad_accum micro-batches before computing any and posts the receive
of the next step's first; by the time a buffer comes round again, the step that read it has been
queued, and NCCL orders the new receive after the queued work. Micro-batch m goes from target
rank m % T to drafter rank m % D; messages between one pair arrive in order, so both sides agree
on m without a handshake.
Messages travel on their own process group (`Topology.exchange_group`), apart from the drafter
ranks' gradient all-reduce and any barrier.
Over gloo (several ranks sharing one GPU) messages are staged in host memory: gloo cannot send
CUDA tensors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashdraft.data.packing import MicroBatchStream, PackedBatch
from flashdraft.distributed.topology import Topology


@dataclass(frozen=True)
class MessageShape:
    rows: int
    seq_len: int
    feature_dim: int
    dtype: torch.dtype

    def buffers(self, count: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.empty(device) for _ in range(count)]

    def empty(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        header = torch.empty(4 * self.rows * self.seq_len + 1, dtype=torch.long, device=device)
        feats = torch.empty(self.rows, self.seq_len, self.feature_dim, dtype=self.dtype, device=device)
        return header, feats


def pack_header(batch: PackedBatch, busy: float, out: torch.Tensor) -> torch.Tensor:
    """Write the batch and the busy fraction into the header buffer `out`."""
    parts = out[:-1].view(4, *batch.input_ids.shape)
    for i, t in enumerate((batch.input_ids, batch.loss_mask, batch.position_ids, batch.doc_ids)):
        parts[i].copy_(t)
    out[-1] = int(busy * 1e6)
    return out


def unpack_header(header: torch.Tensor, shape: MessageShape) -> tuple[PackedBatch, torch.Tensor]:
    """The batch and the sender's busy fraction in parts per million (a device tensor: no sync)."""
    b, s = shape.rows, shape.seq_len
    parts = header[:-1].view(4, b, s)
    return PackedBatch(*parts.unbind(0)), header[-1]


class BusyClock:
    """Fraction of wall time spent computing (not waiting on a peer) over the last `window` items,
    so the figure describes the steady state rather than the start-up."""

    def __init__(self, window: int = 4):
        self.items: deque[tuple[float, float]] = deque(maxlen=window)  # (start, busy seconds)

    def add(self, start: float, seconds: float) -> None:
        self.items.append((start, seconds))

    def fraction(self) -> float:
        if not self.items:
            return 0.0
        span = time.perf_counter() - self.items[0][0]
        return min(1.0, sum(b for _, b in self.items) / max(span, 1e-9))


def serve_features(
    topo: Topology,
    features_fn,
    stream: MicroBatchStream,
    total_micro: int,
    shape: MessageShape,
    start: int = 0,
) -> None:
    """Target rank loop: compute and send every micro-batch this rank owns from global index
    `start` on, at most three sends in flight, each from its own buffer."""
    targets = topo.layout.targets
    first = start + (topo.rank - start) % targets
    buffers = shape.buffers(3, topo.wire_device)
    in_flight: list[list] = []
    clock = BusyClock()
    for m in range(first, total_micro, targets):
        t0 = time.perf_counter()
        cpu = stream[m]
        batch = cpu.to(topo.device)
        feats = features_fn(batch, cpu.plain_causal).to(shape.dtype).contiguous()
        _drain(topo)
        clock.add(t0, time.perf_counter() - t0)
        header, sent = buffers[(m // targets) % len(buffers)]  # its last send completed below
        pack_header(batch, clock.fraction(), header)
        sent.copy_(feats)
        dst = topo.drafter_rank_for(m)
        ops = [
            dist.P2POp(dist.isend, header, dst, topo.exchange_group),
            dist.P2POp(dist.isend, sent, dst, topo.exchange_group),
        ]
        in_flight.append(dist.batch_isend_irecv(ops))
        if len(in_flight) > 2:  # waiting for a drafter to take a message is not busy time
            for work in in_flight.pop(0):
                work.wait()
            _drain(topo)
    for works in in_flight:
        for work in works:
            work.wait()
    _drain(topo)


def _drain(topo: Topology) -> None:
    """Block the host until this rank's queued GPU work (and any NCCL wait it holds) is done."""
    if topo.device.type == "cuda":
        torch.cuda.current_stream().synchronize()


class RemoteFeatures:
    """Drafter rank side: receives micro-batches in order, the next one prefetched.

    Time spent waiting for features is measured without a host sync on GPU: a pair of CUDA events
    around the stream's wait on the receive times how long the GPU stalled for data (not the host,
    which may be a step ahead). The sender's busy fraction stays on the device until read.
    """

    def __init__(self, topo: Topology, shape: MessageShape, grad_accum: int = 1):
        self.topo = topo
        self.shape = shape
        self.buffers = shape.buffers(grad_accum + 1, topo.wire_device)
        self.pending: dict[int, tuple] = {}
        self._wait_s = 0.0
        self._stalls: list[tuple] = []  # CUDA event pairs not yet read
        self._target_busy: torch.Tensor | None = None

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting for features so far (synchronises on GPU)."""
        if self._stalls:
            self._stalls[-1][1].synchronize()
            self._wait_s += sum(a.elapsed_time(b) for a, b in self._stalls) / 1000
            self._stalls.clear()
        return self._wait_s

    @property
    def target_busy(self) -> float:
        """The last sender's busy fraction (its last few micro-batches)."""
        return 0.0 if self._target_busy is None else float(self._target_busy) / 1e6

    def _post(self, m: int) -> None:
        header, feats = self.buffers[(m // self.topo.num_drafters) % len(self.buffers)]
        src = self.topo.target_rank_for(m)
        group = self.topo.exchange_group
        ops = [dist.P2POp(dist.irecv, header, src, group), dist.P2POp(dist.irecv, feats, src, group)]
        self.pending[m] = (dist.batch_isend_irecv(ops), header, feats)

    def get(self, m: int, next_m: int | None) -> tuple[PackedBatch, torch.Tensor]:
        if m not in self.pending:
            self._post(m)
        if next_m is not None and next_m not in self.pending:
            self._post(next_m)
        works, header, feats = self.pending.pop(m)
        cuda_wire = self.topo.wire_device.type == "cuda"
        if cuda_wire:
            before, after = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            before.record()
        t0 = time.perf_counter()
        for work in works:
            work.wait()  # NCCL: the stream waits, the host does not; gloo: the host waits
        if cuda_wire:
            after.record()
            self._stalls.append((before, after))
        else:
            self._wait_s += time.perf_counter() - t0
        batch, self._target_busy = unpack_header(header.to(self.topo.device), self.shape)
        return batch, feats.to(self.topo.device)
