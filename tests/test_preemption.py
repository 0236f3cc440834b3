"""Preemptible runs (docs/runs.md, "Schedulers and preemption"): one `flashdraft train --auto-resume`
command, run again after kill -9 at any moment (before the first save, during a save, after the last
step) or after SIGTERM, ends bit for bit where the uninterrupted run ends; SIGTERM saves and exits 143;
a changed run, or a directory holding what no run writes, is refused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flashdraft.cli.main import PREEMPTED, app
from flashdraft.config import resolve_config
from flashdraft.train import trainer as trainer_module
from flashdraft.train.build import build_trainer
from flashdraft.train.trainer import early_save_step

pytestmark = pytest.mark.slow

STEPS = 40  # steps cost ~12 ms on a 2-core CPU, start-up ~5 s: the kills' windows are the steps between saves
CONFIG = """
data: {seq_len: 128, rows_per_batch: 2}
num_anchors: 8
log_every: 1
save_every: 10
drafter: {num_layers: 1, num_taps: 2}
"""
# one thread: a backward is bit-equal between processes (tests/test_faults.py says why)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FILES = ("model.safetensors", "config.json", "trainer_state.pt", "env.json")


def _args(s, out: Path, *extra: str) -> list[str]:
    run = ["--max-steps", str(STEPS), "--device", "cpu", "--out", str(out), "--auto-resume", *extra]
    return ["train", "--target", str(s.target), "--data", str(s.data), "--config", str(s.cfg), *run]


def _command(s, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flashdraft.cli.main", *_args(s, out, *extra)]


def _master(run: Path) -> dict:
    latest = (run / "checkpoints" / "LATEST").read_text().strip()
    return torch.load(run / "checkpoints" / latest / "trainer_state.pt", weights_only=True)["master"]


def _logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]  # a line being written: not yet


def _latest(run: Path) -> str | None:
    path = run / "checkpoints" / "LATEST"
    return path.read_text().strip() if path.exists() else None


class Launch:
    """The command in its own process, its output in files (a pipe nobody reads would block it)."""

    def __init__(self, cmd: list[str], log: Path):
        self.log = log
        with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=ENV)

    def when(self, predicate, timeout: float = 120) -> bool:
        """Poll every 2 ms until `predicate()` holds (True) or the process ends (False)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if predicate():
                return True
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"nothing happened in {timeout} s: {self.err()[-2000:]}")
            time.sleep(0.002)
        return False

    def signal(self, sig: int) -> int:
        os.kill(self.proc.pid, sig)
        return self.proc.wait(120)

    def finish(self) -> None:
        assert self.proc.wait(120) == 0, self.err()[-3000:]

    def out(self) -> str:
        return Path(f"{self.log}.out").read_text()

    def err(self) -> str:
        return Path(f"{self.log}.err").read_text()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir, token_data_dir):
    """The command's files, and the weights of its uninterrupted run (into a directory that does not
    exist: --auto-resume starts it)."""
    tmp = tmp_path_factory.mktemp("preemption")
    cfg = tmp / "cfg.yaml"
    cfg.write_text(CONFIG)
    s = SimpleNamespace(target=tiny_target_dir, data=token_data_dir, cfg=cfg, tmp=tmp, whole=tmp / "whole")
    run = Launch(_command(s, s.whole), tmp / "whole")
    run.finish()
    assert f"auto-resume: no checkpoint in {s.whole}: starting the run" in run.out()
    s.master = _master(s.whole)
    s.weights = (s.whole / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors").read_bytes()
    return s


def _assert_ends_as_the_uninterrupted_run(s, run: Path) -> None:
    got = _master(run)
    assert all(torch.equal(got[k], s.master[k]) for k in s.master), "the weights differ"
    assert (run / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors").read_bytes() == s.weights
    assert _logged(run) == list(range(1, STEPS + 1))  # each step logged once, none lost
    assert json.loads((run / "result.json").read_text())["steps"] == STEPS


def test_the_same_command_after_kill_9_at_any_moment_ends_as_the_uninterrupted_run(setup):
    s, run = setup, setup.tmp / "killed"
    root = run / "checkpoints"

    # 1. before the first save: the run's files are there, no checkpoint
    first = Launch(_command(s, run), s.tmp / "kill1")
    assert first.when(lambda: (run / "tb").is_dir())  # the last thing a run writes before its first step
    first.signal(signal.SIGKILL)
    assert _latest(run) is None, "the kill came after the first save"
    assert {"config.yaml", "env.json", "metrics.jsonl", "train.log", "tb"} <= {p.name for p in run.iterdir()}

    # 2. during a save (the first of this process, at step 10, or a later one)
    second = Launch(_command(s, run), s.tmp / "kill2")
    assert second.when(lambda: any(root.glob(".tmp-step_*"))), "no kill landed in a save"
    second.signal(signal.SIGKILL)
    removed = "(the run stopped before its first save): removed what it wrote (env.json, metrics.jsonl, tb, "
    assert removed in second.out()
    latest = _latest(run)
    if latest is not None:  # what LATEST names is complete
        assert all((root / latest / f).exists() for f in FILES)

    # 3. after the last step, while or after it saves
    third = Launch(_command(s, run), s.tmp / "kill3")
    assert third.when(lambda: STEPS in _logged(run))
    third.signal(signal.SIGKILL)
    assert ("auto-resume: continuing" in third.out()) == (latest is not None)

    Launch(_command(s, run), s.tmp / "last").finish()
    _assert_ends_as_the_uninterrupted_run(s, run)


def test_sigterm_saves_exits_143_and_the_same_command_continues_from_that_step(setup):
    s, run = setup, setup.tmp / "terminated"
    first = Launch(_command(s, run), s.tmp / "term1")
    assert first.when(lambda: len(_logged(run)) >= 15)  # after the first save, between two
    assert first.signal(signal.SIGTERM) == PREEMPTED == 143
    step = _logged(run)[-1]
    assert 15 <= step < STEPS and _latest(run) == f"step_{step:06d}"
    assert f"preempted (SIGTERM) after step {step}: saved {run / 'checkpoints' / _latest(run)}" in first.err()

    again = Launch(_command(s, run), s.tmp / "term2")
    again.finish()
    assert f"auto-resume: continuing {run} from {run / 'checkpoints' / f'step_{step:06d}'}" in again.out()
    _assert_ends_as_the_uninterrupted_run(s, run)
    # RUN/config.yaml runs it again with --resume: what one invocation did with RUN is not recorded
    assert "auto_resume" not in yaml.safe_load((run / "config.yaml").read_text())["run"]


def test_auto_resume_refuses_a_changed_run_and_out_alone_still_refuses_a_run(setup):
    invoke = CliRunner().invoke
    before = signal.getsignal(signal.SIGTERM)
    changed = invoke(app, _args(setup, setup.whole, "--seed", "1"))
    assert changed.exit_code == 2 and "cannot resume from" in changed.output
    assert "the run changed seed: 0 -> 1" in changed.output
    args = [a for a in _args(setup, setup.whole) if a != "--auto-resume"]
    refused = invoke(app, args)
    assert refused.exit_code == 2 and f"{setup.whole} holds a run" in refused.output
    both = invoke(app, [*args, "--auto-resume", "--overwrite"])
    assert both.exit_code == 2 and "auto_resume decides itself" in both.output
    assert signal.getsignal(signal.SIGTERM) is before  # the command puts its SIGTERM handler back
    assert _latest(setup.whole) == f"step_{STEPS:06d}"  # nothing was written


def _cfg(**over):
    base = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 6, "log_every": 1}
    return resolve_config("default", **{**base, "drafter.num_layers": 1, "drafter.num_taps": 2, **over})


def test_auto_resume_removes_only_what_a_run_that_never_saved_wrote(
    tmp_path, tiny_target_dir, token_data_dir
):
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step_000004").mkdir(parents=True)
    (run / "tb").mkdir()
    for name in ("config.yaml", "env.json", "train.log", "metrics.jsonl"):
        (run / name).write_text("a run that never saved\n")
    (run / "checkpoints" / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match=r"files that no run writes \(checkpoints/notes.txt\): nothing was"):
        build_trainer(_cfg(), tiny_target_dir, token_data_dir, run, device="cpu", auto_resume=True)
    (run / "checkpoints" / "notes.txt").unlink()
    (run / "data.csv").write_text("mine\n")
    with pytest.raises(ValueError, match=r"files that no run writes \(data.csv\)"):
        build_trainer(_cfg(), tiny_target_dir, token_data_dir, run, device="cpu", auto_resume=True)
    assert len(list(run.iterdir())) == 7  # nothing deleted
    (run / "data.csv").unlink()
    trainer = build_trainer(_cfg(), tiny_target_dir, token_data_dir, run, device="cpu", auto_resume=True)
    assert trainer.step == 0 and sorted(p.name for p in run.iterdir()) == [
        "config.yaml"
    ]  # rewritten at start


def test_sigterm_during_start_up_exits_143_naming_the_last_checkpoint(setup, monkeypatch):
    from flashdraft.train import build as build_module

    def build_then_sigterm(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises first
        pytest.fail("SIGTERM did not stop the start-up")

    class NotHandled(Exception):
        pass

    def not_handled(signum, frame):  # what pytest's process does with SIGTERM if the command does not
        raise NotHandled

    monkeypatch.setattr(build_module, "build", build_then_sigterm)
    before = signal.signal(signal.SIGTERM, not_handled)
    try:
        result = CliRunner().invoke(app, _args(setup, setup.whole))
        assert signal.getsignal(signal.SIGTERM) is not_handled  # put back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert result.exit_code == PREEMPTED, result.exception
    last = setup.whole / "checkpoints" / f"step_{STEPS:06d}"
    assert f"terminated (SIGTERM); the last complete checkpoint: {last}" in result.output


def test_sigterm_during_a_save_stops_after_it_and_during_the_last_one_lets_the_run_finish(
    tmp_path, tiny_target_dir, token_data_dir
):
    from flashdraft.train.trainer import Preempted

    def signalled_in_save(trainer, at: int):
        save = trainer.save

        def save_then_sigterm():
            if trainer.step == at:  # handled between two bytecodes: during this save
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # delivered twice, as schedulers' wrappers may
            return save()

        trainer.save = save_then_sigterm
        return trainer

    class NotHandled(Exception):
        pass

    def not_handled(signum, frame):
        raise NotHandled

    before = signal.signal(signal.SIGTERM, not_handled)
    try:
        mid = build_trainer(
            _cfg(save_every=2), tiny_target_dir, token_data_dir, tmp_path / "mid", device="cpu"
        )
        with pytest.raises(Preempted, match=r"preempted \(SIGTERM\) after step 2: saved .*step_000002"):
            signalled_in_save(mid, 2).run()
        assert mid.step == 2  # no step after the save it came in
        last = build_trainer(
            _cfg(save_every=2), tiny_target_dir, token_data_dir, tmp_path / "last", device="cpu"
        )
        assert signalled_in_save(last, 6).run().steps == 6  # the run is complete: no reason to stop it
        assert (tmp_path / "last" / "result.json").is_file()
        assert signal.getsignal(signal.SIGTERM) is not_handled
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_first_checkpoint_of_a_process_comes_once_it_has_trained_as_long_as_it_took_to_start(
    tmp_path, tiny_target_dir, token_data_dir, monkeypatch
):
    assert early_save_step(1, 10.0, 1.0) == 11  # 10 s of start-up, 1 s steps: 10 steps after the first
    assert early_save_step(5, 2.5, 1.0) == 8  # a resumed process counts from its own first step
    assert early_save_step(1, 0.0, 1.0) == early_save_step(1, 0.2, 1.0) == 2  # at least one step after

    seen = []

    def at_step_3(first, startup_s, step_s):
        seen.append((first, startup_s > 0, step_s > 0))
        return 3

    monkeypatch.setattr(trainer_module, "early_save_step", at_step_3)

    def saved(name, started, **over):
        trainer = build_trainer(_cfg(**over), tiny_target_dir, token_data_dir, tmp_path / name, device="cpu")
        trainer.run(started=started)
        return sorted(p.name for p in (tmp_path / name / "checkpoints").glob("step_*"))

    now = time.time()
    assert saved("early", now) == ["step_000003", "step_000006"] and seen == [(1, True, True)]
    assert saved("periodic-first", now, save_every=2) == ["step_000002", "step_000004", "step_000006"]
    assert saved("off", now, early_save=False) == saved("no-start", None) == ["step_000006"]


def test_several_ranks_start_over_a_run_that_never_saved_stop_on_sigterm_and_continue(setup):
    """--nproc 2: the main rank decides for every rank (and alone removes what the unsaved run left);
    SIGTERM to the launcher stops the ranks at once with 143 (they save nothing: a run of several ranks
    continues from its last checkpoint), and the same command continues from it."""
    s, run = setup, setup.tmp / "ranks"
    (run / "checkpoints" / ".tmp-step_000010").mkdir(parents=True)
    (run / "train.log").write_text("step 1/40 loss 6.0\n")
    first = Launch(_command(s, run, "--nproc", "2"), s.tmp / "ranks1")
    assert first.when(lambda: _latest(run) is not None and len(_logged(run)) >= 15)
    assert first.signal(signal.SIGTERM) == PREEMPTED
    assert first.out().count("removed what it wrote (checkpoints, train.log) and starting it again") == 1
    latest = _latest(run)
    assert (
        f"terminated (SIGTERM); the last complete checkpoint: {run / 'checkpoints' / latest}" in first.err()
    )

    again = Launch(_command(s, run, "--nproc", "2"), s.tmp / "ranks2")
    again.finish()
    assert again.out().count(f"auto-resume: continuing {run} from {run / 'checkpoints' / latest}") == 1
    assert _logged(run) == list(range(1, STEPS + 1))
    assert json.loads((run / "result.json").read_text())["steps"] == STEPS
