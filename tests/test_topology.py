"""Process-group set-up: the backend a user asks for is the backend the group gets."""

import pytest
import torch
import torch.distributed as dist

from flashdraft.dist.topology import init_topology


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

    from flashdraft.dist.parallel import parallelize

    topo = SimpleNamespace(num_drafters=2, is_drafter=True, device=torch.device("cuda", 0), backend="gloo")
    with pytest.raises(ValueError, match="needs NCCL"):
        parallelize(torch.nn.Linear(2, 2), topo, fsdp=True)
