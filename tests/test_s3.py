"""The S3 mirror and restore against a real S3 API (moto_server on localhost), outage included."""

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import boto3
import pytest

from flashdraft.model.checkpoint import latest_checkpoint
from flashdraft.run import s3
from flashdraft.run.s3 import MARKER, S3Mirror, parse_s3_url, restore_run

SECRET = "fake-secret-7f3a9c"
ACCESS_KEY = "FAKEACCESSKEY123"


class MotoServer:
    """moto_server in its own process on 127.0.0.1; in-memory, so a restart starts empty."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self.answers():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"moto_server did not start on port {self.port}")
            time.sleep(0.1)

    def answers(self) -> bool:
        try:
            urllib.request.urlopen(self.url, timeout=1)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="module")
def server():
    srv = MotoServer()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    """Fake credentials; nothing from this machine's AWS configuration."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


def new_bucket(server: MotoServer, monkeypatch, name: str):
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    client = boto3.client("s3")
    client.create_bucket(Bucket=name)
    return client


def fake_checkpoint(path: Path, seed: int = 0) -> Path:
    (path / "optimizer").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(300_000 + seed))
    (path / "config.json").write_text(json.dumps({"step": seed}))
    (path / "optimizer" / "trainer_state.pt").write_bytes(os.urandom(5000))
    (path / "env.json").write_text("{}")
    return path


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def stored(client, bucket: str) -> dict[str, bytes]:
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def recording_client(written: list[str], fail_key: str | None = None):
    """s3_client whose PutObject calls are recorded in order; `fail_key` fails every time."""
    real = s3.s3_client

    def make(endpoint_url=None, attempts=None):
        client = real(endpoint_url, attempts)

        def record(params, **_):
            if params["Key"] == fail_key:
                raise ConnectionError("injected failure")
            written.append(params["Key"])

        client.meta.events.register("provide-client-params.s3.PutObject", record)
        return client

    return make


@pytest.mark.parametrize(
    "url, expected",
    [("s3://my-bucket/runs/a/", ("my-bucket", "runs/a")), ("s3://my-bucket", ("my-bucket", ""))],
)
def test_parse_s3_url(url, expected):
    assert parse_s3_url(url) == expected


@pytest.mark.parametrize(
    "url, message",
    [
        ("my-bucket/runs", "not an S3 URL"),
        ("https://my-bucket/runs", "not an S3 URL"),
        ("s3://", "invalid bucket name"),
        ("s3://My_Bucket/runs", "invalid bucket name"),
    ],
)
def test_parse_s3_url_rejects_what_is_not_a_bucket(url, message):
    with pytest.raises(ValueError, match=message):
        parse_s3_url(url)


def test_mirrored_checkpoint_has_every_file_then_its_marker_then_latest(server, monkeypatch, tmp_path):
    client = new_bucket(server, monkeypatch, "mirror-order")
    ckpt = fake_checkpoint(tmp_path / "run" / "checkpoints" / "step_000010")
    (tmp_path / "run" / "train.log").write_text("step 10 loss 1.0\n")
    written: list[str] = []
    monkeypatch.setattr(s3, "s3_client", recording_client(written))
    done: list[Path] = []

    mirror = S3Mirror("s3://mirror-order/runs/a")
    mirror.submit_dir(ckpt, "checkpoints/step_000010", on_done=done.append)
    mirror.submit_file(tmp_path / "run" / "train.log", "train.log")
    assert mirror.close(timeout=30)

    assert done == [ckpt] and mirror.pending() == 0
    prefix = "runs/a/checkpoints/"
    objects = stored(client, "mirror-order")
    expected = {prefix + "step_000010/" + rel: data for rel, data in files_of(ckpt).items()}
    assert {
        k: v for k, v in objects.items() if k.startswith(prefix + "step_000010/") and MARKER not in k
    } == (expected)
    assert objects["runs/a/train.log"] == b"step 10 loss 1.0\n"
    assert objects[prefix + "LATEST"] == b"step_000010\n"
    manifest = json.loads(objects[prefix + "step_000010/" + MARKER])["files"]
    assert manifest == {rel: len(data) for rel, data in files_of(ckpt).items()}
    assert written[0] == "runs/a/.flashdraft-access-check"  # the check at start, deleted again
    assert "runs/a/.flashdraft-access-check" not in objects
    assert written[-3:] == [prefix + "step_000010/" + MARKER, prefix + "LATEST", "runs/a/train.log"]
    assert set(written[1:-3]) == set(expected)


def test_a_file_that_cannot_be_written_leaves_the_directory_unmarked(server, monkeypatch, tmp_path, caplog):
    client = new_bucket(server, monkeypatch, "mirror-giveup")
    ckpt = fake_checkpoint(tmp_path / "step_000010")
    monkeypatch.setattr(
        s3, "s3_client", recording_client([], fail_key="checkpoints/step_000010/model.safetensors")
    )
    done: list[Path] = []

    mirror = S3Mirror("s3://mirror-giveup", max_retries=2, backoff=0.01)
    mirror.submit_dir(ckpt, "checkpoints/step_000010", on_done=done.append)
    assert mirror.close(timeout=30)

    keys = set(stored(client, "mirror-giveup"))
    assert done == []
    assert "checkpoints/step_000010/config.json" in keys
    assert not any(k.endswith(MARKER) or k.endswith("LATEST") for k in keys)
    assert (
        "gave up on s3://mirror-giveup/checkpoints/step_000010/model.safetensors after 3 attempts"
        in caplog.text
    )


def test_uploads_wait_out_an_outage_without_blocking_training(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="flashdraft.run.s3")
    srv = MotoServer()
    srv.start()
    try:
        new_bucket(srv, monkeypatch, "mirror-outage")
        ckpt = fake_checkpoint(tmp_path / "step_000010")
        (tmp_path / "metrics.jsonl").write_text('{"step": 10}\n')
        mirror = S3Mirror("s3://mirror-outage/r", max_retries=10, backoff=0.2)
        srv.stop()
        done: list[Path] = []

        started = time.perf_counter()
        mirror.submit_dir(ckpt, "checkpoints/step_000010", on_done=done.append)
        mirror.submit_file(tmp_path / "metrics.jsonl", "metrics.jsonl")
        assert time.perf_counter() - started < 0.5
        time.sleep(1.5)
        assert done == [] and mirror.pending() == 2

        srv.start()
        client = new_bucket(srv, monkeypatch, "mirror-outage")
        assert mirror.close(timeout=40)
        assert done == [ckpt] and mirror.pending() == 0
        objects = stored(client, "mirror-outage")
        assert (
            objects["r/checkpoints/step_000010/model.safetensors"]
            == (ckpt / "model.safetensors").read_bytes()
        )
        assert objects["r/checkpoints/LATEST"] == b"step_000010\n"
        assert objects["r/metrics.jsonl"] == b'{"step": 10}\n'
    finally:
        srv.stop()
    assert "retry 1/10" in caplog.text
    assert SECRET not in caplog.text and ACCESS_KEY not in caplog.text


def mirror_run(run: Path, url: str) -> None:
    mirror = S3Mirror(url)
    for name in ("config.yaml", "metrics.jsonl", "train.log"):
        mirror.submit_file(run / name, name)
    for ckpt in sorted((run / "checkpoints").iterdir()):
        mirror.submit_dir(ckpt, f"checkpoints/{ckpt.name}")
    assert mirror.close(timeout=30)


def make_run(run: Path) -> Path:
    for step in (10, 20):
        fake_checkpoint(run / "checkpoints" / f"step_{step:06d}", seed=step)
    (run / "config.yaml").write_text("lr: 0.0006\n")
    (run / "metrics.jsonl").write_text('{"step": 10}\n{"step": 20}\n')
    (run / "train.log").write_text("step 20\n")
    return run


def test_restore_run_rebuilds_the_newest_checkpoint_and_run_files_byte_for_byte(
    server, monkeypatch, tmp_path
):
    new_bucket(server, monkeypatch, "mirror-restore")
    run = make_run(tmp_path / "run")
    mirror_run(run, "s3://mirror-restore/runs/x")

    fresh = tmp_path / "fresh"
    restored = restore_run("s3://mirror-restore/runs/x", fresh)

    assert restored == fresh / "checkpoints" / "step_000020"
    assert latest_checkpoint(fresh / "checkpoints") == restored
    assert files_of(restored) == files_of(run / "checkpoints" / "step_000020")
    for name in ("config.yaml", "metrics.jsonl", "train.log"):
        assert (fresh / name).read_bytes() == (run / name).read_bytes()
    assert not (fresh / "env.json").exists()
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["LATEST", "step_000020"]


def test_a_checkpoint_without_its_marker_is_never_restored(server, monkeypatch, tmp_path):
    client = new_bucket(server, monkeypatch, "mirror-partial")
    run = make_run(tmp_path / "run")
    mirror = S3Mirror("s3://mirror-partial")
    mirror.submit_dir(run / "checkpoints" / "step_000010", "checkpoints/step_000010")
    assert mirror.close(timeout=30)
    # step_000020 arrived without its marker, and LATEST was (wrongly) moved to it
    for rel, data in files_of(run / "checkpoints" / "step_000020").items():
        client.put_object(Bucket="mirror-partial", Key=f"checkpoints/step_000020/{rel}", Body=data)
    client.put_object(Bucket="mirror-partial", Key="checkpoints/LATEST", Body=b"step_000020\n")

    restored = restore_run("s3://mirror-partial", tmp_path / "fresh")

    assert restored == tmp_path / "fresh" / "checkpoints" / "step_000010"
    assert files_of(restored) == files_of(run / "checkpoints" / "step_000010")
    assert not (tmp_path / "fresh" / "checkpoints" / "step_000020").exists()


def test_restore_without_any_complete_checkpoint_returns_none_and_writes_nothing(
    server, monkeypatch, tmp_path
):
    client = new_bucket(server, monkeypatch, "mirror-empty")
    client.put_object(Bucket="mirror-empty", Key="r/checkpoints/step_000010/model.safetensors", Body=b"x")
    client.put_object(Bucket="mirror-empty", Key="r/config.yaml", Body=b"lr: 1\n")

    assert restore_run("s3://mirror-empty/r", tmp_path / "fresh") is None
    assert not (tmp_path / "fresh").exists()


def test_submit_after_close_is_refused(server, monkeypatch, tmp_path):
    new_bucket(server, monkeypatch, "mirror-closed")
    mirror = S3Mirror("s3://mirror-closed")
    assert mirror.close(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        mirror.submit_file(tmp_path / "x", "x")


def test_training_mirrors_to_s3_and_resumes_on_a_fresh_machine(
    server, monkeypatch, tmp_path, tiny_target_dir
):
    """`train --s3` uploads checkpoints; `--resume s3://...` into an empty directory continues the run."""
    import json as _json

    from flashdraft.config import resolve_config
    from flashdraft.data.packing import save_token_dataset
    from flashdraft.train.build import build_trainer
    from helpers import random_docs

    new_bucket(server, monkeypatch, "runs")
    save_token_dataset(random_docs([70, 90, 120, 60] * 3, seed=4, prompt_len=10), tmp_path / "data")
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 4, "save_every": 2}
    cfg = resolve_config("default", **over, **{"drafter.num_layers": 1, "drafter.num_taps": 2})
    url = "s3://runs/exp1"
    first = build_trainer(cfg, tiny_target_dir, tmp_path / "data", tmp_path / "a", device="cpu", s3_url=url)
    for _ in range(2):
        first.train_step()
    first.save()
    assert first.checkpoints.mirror.close(timeout=60)

    fresh = tmp_path / "fresh-machine"
    resumed = build_trainer(
        cfg, tiny_target_dir, tmp_path / "data", fresh, device="cpu", resume=True, s3_url=url
    )
    assert resumed.step == 2
    assert (fresh / "checkpoints" / "LATEST").read_text().strip() == "step_000002"
    resumed.run()
    assert _json.loads((fresh / "result.json").read_text())["steps"] == 4


def test_auto_resume_starts_with_an_empty_mirror_and_continues_from_it_on_a_fresh_machine(
    server, monkeypatch, tmp_path, tiny_target_dir, capsys
):
    """--auto-resume with --s3: no checkpoint here or in the bucket starts the run; on another machine,
    where a run that never saved left its files, those go and the bucket's checkpoint continues it."""
    from flashdraft.config import resolve_config
    from flashdraft.data.packing import save_token_dataset
    from flashdraft.train.build import build_trainer
    from helpers import random_docs

    new_bucket(server, monkeypatch, "auto")
    save_token_dataset(random_docs([70, 90, 120, 60] * 3, seed=4, prompt_len=10), tmp_path / "data")
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 4}
    cfg = resolve_config("default", **over, **{"drafter.num_layers": 1, "drafter.num_taps": 2})
    url, data = "s3://auto/exp1", tmp_path / "data"
    first = build_trainer(
        cfg, tiny_target_dir, data, tmp_path / "a", device="cpu", s3_url=url, auto_resume=True
    )
    assert (
        first.step == 0 and f"no checkpoint in {tmp_path / 'a'} or {url}: starting" in capsys.readouterr().out
    )
    for _ in range(2):
        first.train_step()
    first.save()
    assert first.checkpoints.mirror.close(timeout=60)

    fresh = tmp_path / "fresh-machine"
    (fresh / "checkpoints" / ".tmp-step_000001").mkdir(parents=True)
    (fresh / "train.log").write_text("step 1/4 loss 6.0\n")
    resumed = build_trainer(cfg, tiny_target_dir, data, fresh, device="cpu", s3_url=url, auto_resume=True)
    assert resumed.step == 2
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["LATEST", "step_000002"]
    assert f"restored from {url}" in capsys.readouterr().out


def test_a_run_stopped_by_sigterm_waits_until_its_last_checkpoint_is_in_the_bucket(
    server, monkeypatch, tmp_path, tiny_target_dir
):
    """The machine goes after SIGTERM, and its disk with it: the checkpoint the signal saved must be in
    the bucket before the process exits."""
    import signal

    from flashdraft.config import resolve_config
    from flashdraft.data.packing import save_token_dataset
    from flashdraft.train.build import build_trainer
    from flashdraft.train.trainer import Preempted
    from helpers import random_docs, signal_after_step

    client = new_bucket(server, monkeypatch, "preempted")
    save_token_dataset(random_docs([70, 90, 120, 60] * 3, seed=4, prompt_len=10), tmp_path / "data")
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 6}
    cfg = resolve_config("default", **over, **{"drafter.num_layers": 1, "drafter.num_taps": 2})
    trainer = build_trainer(cfg, tiny_target_dir, tmp_path / "data", tmp_path / "run", device="cpu",
                            s3_url="s3://preempted/r")  # fmt: skip
    signal_after_step(trainer, 2, signal.SIGTERM)
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)  # if the trainer did not catch it
    try:
        with pytest.raises(Preempted, match="after step 2"):
            trainer.run()
    finally:
        signal.signal(signal.SIGTERM, before)
    keys = stored(client, "preempted")
    assert keys["r/checkpoints/LATEST"] == b"step_000002\n" and "r/checkpoints/step_000002/.complete" in keys
    assert "r/metrics.jsonl" in keys


def test_a_store_that_cannot_be_written_is_an_error_before_the_run_starts(server, monkeypatch, tmp_path):
    new_bucket(server, monkeypatch, "exists")
    with pytest.raises(ValueError, match=r"cannot write to s3://no-such-bucket/r \(NoSuchBucket"):
        S3Mirror("s3://no-such-bucket/r")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    with pytest.raises(ValueError, match=r"cannot write to s3://exists/r \(EndpointConnectionError\)"):
        S3Mirror("s3://exists/r")
    with pytest.raises(ValueError, match=r"cannot read s3://exists/r"):
        restore_run("s3://exists/r", tmp_path / "run")


def test_a_run_whose_mirror_did_not_complete_ends_with_an_error_naming_it(
    monkeypatch, tmp_path, tiny_target_dir
):
    """The store goes away after the start: training finishes, waits `s3_wait_s` for the mirror, and
    stops with an error (exit 1 from the command) instead of exit 0 with nothing uploaded."""
    from flashdraft.config import resolve_config
    from flashdraft.data.packing import save_token_dataset
    from flashdraft.train.build import build_trainer
    from flashdraft.train.state import MirrorIncomplete
    from helpers import random_docs

    srv = MotoServer()
    srv.start()
    try:
        new_bucket(srv, monkeypatch, "runs")
        save_token_dataset(random_docs([70, 90, 120, 60] * 3, seed=4, prompt_len=10), tmp_path / "data")
        over = {
            "data.seq_len": 128,
            "data.rows_per_batch": 2,
            "num_anchors": 8,
            "max_steps": 2,
            "s3_wait_s": 1,
        }
        cfg = resolve_config("default", **over, **{"drafter.num_layers": 1, "drafter.num_taps": 2})
        trainer = build_trainer(cfg, tiny_target_dir, tmp_path / "data", tmp_path / "run", device="cpu",
                                s3_url="s3://runs/r")  # fmt: skip
    finally:
        srv.stop()
    with pytest.raises(MirrorIncomplete, match=r"uploads still queued after 1 s \(s3_wait_s\)"):
        trainer.run()
    assert (tmp_path / "run" / "result.json").is_file() and latest_checkpoint(
        tmp_path / "run" / "checkpoints"
    )
