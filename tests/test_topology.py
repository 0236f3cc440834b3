"""Process-group set-up: the backend a user asks for is the backend the group gets."""

import pytest
import torch
import torch.distributed as dist

from flashdraft.distributed.topology import init_topology


@pytest.mark.parametrize(("asked", "device", "made"), [("gloo", "cuda", "gloo"), ("auto", "cuda", "nccl")])
def test_the_asked_backend_is_used_on_a_gpu(monkeypatch, asked, device, made):
    """gloo is how several ranks share one GPU (NCCL refuses two ranks on one device): auto must not
    turn it back into NCCL. No GPU here, so the CUDA and process-group calls are recorded, not made."""
    groups = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: groups.append(backend))
    init_topology("colocated", device, asked)
    assert groups == [made]


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend 'mpi'"):
        init_topology("colocated", "cpu", "mpi")


def test_ranks_sharing_a_gpu_over_gloo_stage_messages_in_host_memory(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: None)
    monkeypatch.setattr(dist, "new_group", lambda ranks: None)
    assert init_topology("split:1:1", "cuda", "gloo").wire_device == torch.device("cpu")  # gloo: no CUDA p2p
    assert init_topology("split:1:1", "cuda", "auto").wire_device == torch.device("cuda", 0)


def test_fsdp_over_gloo_on_a_gpu_is_refused():
    from types import SimpleNamespace

    from flashdraft.distributed.parallel import parallelize

    topo = SimpleNamespace(num_drafters=2, is_drafter=True, device=torch.device("cuda", 0), backend="gloo")
    with pytest.raises(ValueError, match="needs NCCL"):
        parallelize(torch.nn.Linear(2, 2), topo, fsdp=True)


def _drafter_max_worker(rank: int, port: int, out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3", RANK=str(rank))
    topo = init_topology("split:1:2", "cpu")
    if topo.is_drafter:  # ranks 1 and 2 waited 1 s and 2 s for features
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(topo.drafter_max(float(rank))))
    topo.close()


def test_the_drafter_group_waits_as_long_as_its_worst_fed_rank(tmp_path):
    """Split layout busy fractions: every drafter rank reports the longest wait of the group (the
    others wait for that rank in the gradient all-reduce), not its own."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_drafter_max_worker, args=(port, str(tmp_path / "max")), nprocs=3)
    assert [float((tmp_path / f"max.{r}").read_text()) for r in (1, 2)] == [2.0, 2.0]


def test_feature_messages_travel_on_their_own_process_group_in_reused_buffers(monkeypatch):
    """Split layouts: every send and receive of features names the exchange group, so messages
    never queue behind the gradient all-reduce or a barrier of another group; and both sides reuse
    buffers allocated once: three on a target rank, grad_accum + 1 on a drafter rank."""
    from types import SimpleNamespace

    from flashdraft.data.packing import PackedBatch
    from flashdraft.distributed.exchange import MessageShape, RemoteFeatures, serve_features
    from flashdraft.distributed.topology import Layout, Topology

    sent = []
    op = lambda op, tensor, peer, group=None: SimpleNamespace(op=op, tensor=tensor, group=group)  # noqa: E731
    monkeypatch.setattr(dist, "P2POp", op)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: sent.extend(ops) or [])
    group = object()
    ids = torch.zeros(1, 8, dtype=torch.long)
    stream = [PackedBatch(ids + m, ids, ids, ids) for m in range(7)]
    shape = MessageShape(1, 8, 4, torch.float32)
    target = Topology(0, 2, 0, Layout.parse("split:1:1"), exchange_group=group)
    serve_features(target, lambda batch, plain: torch.zeros(1, 8, 4), stream, 7, shape)
    assert [o.op for o in sent] == [dist.isend] * 14 and all(o.group is group for o in sent)
    assert len({o.tensor.data_ptr() for o in sent}) == 6  # 3 headers and 3 feature buffers
    assert int(sent[12].tensor[0]) == 6  # the last message's header holds its own ids
    sent.clear()
    drafter = RemoteFeatures(Topology(1, 2, 1, Layout.parse("split:1:1"), exchange_group=group), shape, 2)
    for m in range(7):
        drafter._post(m)
    assert [o.op for o in sent] == [dist.irecv] * 14 and all(o.group is group for o in sent)
    assert len({o.tensor.data_ptr() for o in sent}) == 6  # grad_accum 2: 3 headers, 3 buffers
