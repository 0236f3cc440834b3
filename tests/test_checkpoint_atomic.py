"""A checkpoint is complete or absent, and LATEST always names a complete one: every file operation of a
save (writes, fsyncs, renames, deletions) is made to fail in turn, the restart's clean-up runs, and
LATEST must still name a complete checkpoint, the old one or the new. Deterministic, where the random
SIGKILLs of tests/test_faults.py only find an ordering mistake by chance."""

import os
import shutil

import pytest
import safetensors.torch

from flashdraft.model import checkpoint
from flashdraft.model.checkpoint import latest_checkpoint, remove_partial_checkpoints, save_checkpoint
from helpers import target_and_drafter

FILES = ("config.json", "model.safetensors", "trainer_state.pt")


class Injected(OSError):
    pass


@pytest.fixture
def fail_at(monkeypatch):
    """fail_at(k): the k-th file operation of what follows raises; returns the list of operations run."""
    calls: list[str] = []
    state = {"at": None}

    def wrap(name, fn):
        def op(*args, **kwargs):
            calls.append(name)
            if len(calls) == state["at"]:
                raise Injected(f"injected failure of {name}")
            return fn(*args, **kwargs)

        return op

    for module, name in ((os, "replace"), (os, "fsync"), (shutil, "rmtree")):
        monkeypatch.setattr(module, name, wrap(name, getattr(module, name)))
    monkeypatch.setattr(checkpoint, "save_file", wrap("save_file", safetensors.torch.save_file))

    def arm(k):
        calls.clear()
        state["at"] = k
        return calls

    return arm


def _complete(path) -> bool:
    return path is not None and all((path / f).is_file() for f in FILES)


def _state_writer(tag: bytes):
    return lambda path: path.write_bytes(tag)


@pytest.mark.parametrize("replacing", [False, True], ids=["new step", "same step again"])
def test_every_failed_operation_of_a_save_leaves_latest_naming_a_complete_checkpoint(
    tmp_path, fail_at, replacing
):
    _, drafter = target_and_drafter()
    root = tmp_path / "checkpoints"
    fail_at(None)
    save_checkpoint(drafter, root, 1, {"trainer_state.pt": _state_writer(b"old")})
    step = 1 if replacing else 2
    k = 0
    while True:
        k += 1
        calls = fail_at(k)
        try:
            save_checkpoint(drafter, root, step, {"trainer_state.pt": _state_writer(b"new")})
        except Injected:
            pass
        else:
            break
        fail_at(None)
        remove_partial_checkpoints(root)  # what a restarted run does first
        latest = latest_checkpoint(root)
        assert _complete(latest), f"failing operation {k} ({calls[-1]}) left LATEST naming {latest}"
        assert (latest / "trainer_state.pt").read_bytes() in (b"old", b"new")
        assert not [p.name for p in root.iterdir() if p.name.startswith(".") and p.is_dir()]
    assert k > 8 and "replace" in calls  # every operation was failed once: writes, fsyncs, renames
    latest = latest_checkpoint(root)
    assert latest.name == f"step_{step:06d}" and (latest / "trainer_state.pt").read_bytes() == b"new"
