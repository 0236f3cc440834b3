"""Mirror a run directory to S3-compatible storage in the background, and restore a run from it.

A run on a preemptible machine must outlive it: checkpoints, train.log and metrics.jsonl are
copied to `s3://bucket/prefix/` as they are written, and `restore_run` rebuilds the run directory on
a fresh machine so training resumes there. Training never waits on the store: one background thread
uploads and retries with exponential backoff through outages. boto3 moves the bytes and resolves
credentials, region and endpoint from the standard AWS environment; what is written here is only the
order of the writes, so that a reader sees a checkpoint complete or not at all:

    prefix/checkpoints/step_000690/<files>      every file, each confirmed by its size on the store
    prefix/checkpoints/step_000690/.complete    then the marker: a manifest {relative path: size}
    prefix/checkpoints/LATEST                   then the pointer: "step_000690"

Log lines name buckets and keys, never credentials. boto3 is imported only where a client is made.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.model.checkpoint import LATEST

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MARKER = ".complete"
RUN_FILES = ("config.yaml", "env.json", "metrics.jsonl", "train.log")
MAX_BACKOFF_S = 60.0
ACCESS_PROBE = ".flashdraft-access-check"
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


class UploadFailed(RuntimeError):
    """An object could not be written within the retry budget."""


def parse_s3_url(url: str) -> tuple[str, str]:
    """ "s3://bucket/some/prefix" -> ("bucket", "some/prefix"); the prefix may be empty."""
    scheme, sep, rest = url.partition("://")
    if scheme != "s3" or not sep:
        raise ValueError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = rest.partition("/")
    if not BUCKET_NAME.fullmatch(bucket):
        raise ValueError(
            f"invalid bucket name {bucket!r} in {url!r}: 3-63 lowercase letters, digits, '.' or '-'"
        )
    return bucket, prefix.strip("/")


def s3_client(endpoint_url: str | None = None, attempts: int | None = None) -> Any:
    """A boto3 S3 client configured from the standard AWS environment (AWS_ENDPOINT_URL_S3 included).

    attempts=1 leaves retrying to the caller; None keeps botocore's default policy.
    """
    import boto3
    from botocore.config import Config

    retries = {"total_max_attempts": attempts} if attempts else {"mode": "standard"}
    config = Config(retries=retries, connect_timeout=10, read_timeout=120)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


@dataclass(frozen=True)
class _Store:
    """One bucket and prefix: key naming and the reads and writes both sides need."""

    client: Any
    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def upload(self, path: Path, key: str) -> int:
        """Upload and confirm by the size the store reports; returns that size."""
        size = path.stat().st_size
        self.client.upload_file(str(path), self.bucket, key)
        stored = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        if stored != size:
            raise OSError(f"{self.url(key)} holds {stored} bytes, {path} has {size}")
        return size

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def download(self, key: str, dest: Path) -> bool:
        """Download to dest; False when the object does not exist."""
        from botocore.exceptions import ClientError

        try:
            self.client.download_file(self.bucket, key, str(dest))
        except ClientError as e:
            if _error_code(e) in ("404", "NoSuchKey"):
                return False
            raise
        return True

    def subdirectories(self, *parts: str) -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self.key(*parts) + "/", Delimiter="/")
        return [
            p["Prefix"].rstrip("/").rsplit("/", 1)[-1]
            for page in pages
            for p in page.get("CommonPrefixes", [])
        ]


def _error_code(e: Exception) -> str | None:
    return getattr(e, "response", {}).get("Error", {}).get("Code")


def _describe(e: Exception) -> str:
    """The error's type and S3 code only: messages can quote request details."""
    code = _error_code(e)
    return f"{type(e).__name__} {code}" if code else type(e).__name__


class S3Mirror:
    """Copies run files to s3://bucket/prefix from one background thread; submitting never blocks.

    Jobs run in submission order. A job whose object cannot be written after `max_retries` retries
    (delays backoff, 2*backoff, ... capped at MAX_BACKOFF_S) is given up, logged and listed in `failed`;
    later jobs go on. The store is checked at once (`check_access`): a wrong endpoint, bucket or
    credentials is an error before the run starts, not a run that mirrors nothing.
    """

    def __init__(
        self, url: str, endpoint_url: str | None = None, max_retries: int = 8, backoff: float = 1.0
    ) -> None:
        bucket, prefix = parse_s3_url(url)
        self._store = _Store(s3_client(endpoint_url, attempts=1), bucket, prefix)
        self.check_access()
        self.max_retries = max_retries
        self.backoff = backoff
        self.failed: list[str] = []  # what was given up, for the end of the run to name
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="s3-mirror", daemon=True)
        self._worker.start()

    def check_access(self) -> None:
        """Write and delete a small object under the prefix; ValueError naming the store if it fails."""
        key = self._store.key(ACCESS_PROBE)
        try:
            self._store.put(key, b"flashdraft checks it may write here\n")
            self._store.client.delete_object(Bucket=self._store.bucket, Key=key)
        except Exception as e:
            raise ValueError(
                f"cannot write to {self._store.url(self._store.key())} ({_describe(e)}): check the endpoint "
                "(AWS_ENDPOINT_URL_S3), the bucket and the credentials in the environment"
            ) from None

    def submit_file(self, path: Path, key: str) -> None:
        """Upload one file to prefix/key (e.g. "metrics.jsonl"); a later submit of the key overwrites it."""
        self._submit(lambda: self._upload(Path(path), self._store.key(key)))

    def submit_dir(
        self, local_dir: Path, key_prefix: str, on_done: Callable[[Path], None] | None = None
    ) -> None:
        """Upload every file of local_dir under prefix/key_prefix, then its .complete marker, then LATEST
        beside it naming it; on_done(local_dir) only once all of that is confirmed written.

        A checkpoint goes to key_prefix f"checkpoints/{ckpt_dir.name}", where restore_run looks.
        """
        self._submit(lambda: self._upload_dir(Path(local_dir), key_prefix.strip("/"), on_done))

    def pending(self) -> int:
        """Jobs submitted and not yet finished (written or given up)."""
        with self._lock:
            return self._pending

    @property
    def closed(self) -> bool:
        """Whether `close` was called (no more jobs are accepted)."""
        with self._lock:
            return self._closed

    def close(self, timeout: float | None = None) -> bool:
        """Accept no more jobs and wait up to `timeout` s for the queued ones; True when all finished."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        self._worker.join(timeout)
        return not self._worker.is_alive()

    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("S3Mirror is closed")
            self._pending += 1
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except UploadFailed as e:
                log.error("s3 mirror: %s", e)
                self.failed.append(str(e))
            except Exception as e:  # a vanished local file or a failing on_done must not stop later jobs
                log.exception("s3 mirror: job failed")
                self.failed.append(f"a job failed ({type(e).__name__})")
            finally:
                with self._lock:
                    self._pending -= 1

    def _upload_dir(self, local_dir: Path, key_prefix: str, on_done: Callable[[Path], None] | None) -> None:
        manifest = {}
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = path.relative_to(local_dir).as_posix()
            manifest[rel] = self._upload(path, self._store.key(key_prefix, rel))
        self._put(self._store.key(key_prefix, MARKER), json.dumps({"files": manifest}).encode())
        parent, _, name = key_prefix.rpartition("/")
        self._put(self._store.key(parent, LATEST), f"{name}\n".encode())
        log.info(
            "s3 mirror: %s complete (%d files)", self._store.url(self._store.key(key_prefix)), len(manifest)
        )
        if on_done is not None:
            on_done(local_dir)

    def _upload(self, path: Path, key: str) -> int:
        return self._retry(key, lambda: self._store.upload(path, key))

    def _put(self, key: str, data: bytes) -> None:
        self._retry(key, lambda: self._store.put(key, data))

    def _retry(self, key: str, action: Callable[[], Any]) -> Any:
        for attempt in range(self.max_retries + 1):
            try:
                return action()
            except FileNotFoundError:
                raise  # the local file is gone: no retry brings it back
            except Exception as e:
                if attempt == self.max_retries:
                    raise UploadFailed(
                        f"gave up on {self._store.url(key)} after {attempt + 1} attempts ({_describe(e)})"
                    ) from None
                delay = min(self.backoff * 2**attempt, MAX_BACKOFF_S)
                log.warning(
                    "s3 mirror: %s failed (%s), retry %d/%d in %.1f s",
                    self._store.url(key),
                    _describe(e),
                    attempt + 1,
                    self.max_retries,
                    delay,
                )
                time.sleep(delay)


def restore_run(url: str, local_run_dir: Path, endpoint_url: str | None = None) -> Path | None:
    """Rebuild a run directory from its mirror: the newest complete checkpoint, checkpoints/LATEST and
    the run files (config.yaml, env.json, metrics.jsonl, train.log when present).

    Returns the restored checkpoint directory, or None (and writes nothing) when the mirror holds no
    checkpoint with its .complete marker.
    """
    bucket, prefix = parse_s3_url(url)
    store = _Store(s3_client(endpoint_url), bucket, prefix)
    try:
        found = _newest_complete(store)
    except Exception as e:
        raise ValueError(
            f"cannot read {url} ({_describe(e)}): check the endpoint (AWS_ENDPOINT_URL_S3), the bucket "
            "and the credentials in the environment"
        ) from None
    if found is None:
        return None
    name, files = found
    run = Path(local_run_dir)
    run.mkdir(parents=True, exist_ok=True)
    for run_file in RUN_FILES:
        store.download(store.key(run_file), run / run_file)
    return _restore_checkpoint(store, name, files, run / CHECKPOINTS)


def _newest_complete(store: _Store) -> tuple[str, dict[str, int]] | None:
    """LATEST's checkpoint when its marker is there, else the newest one that has a marker."""
    latest = store.read(store.key(CHECKPOINTS, LATEST))
    candidates = [latest.decode().strip()] if latest else []
    candidates += sorted(store.subdirectories(CHECKPOINTS), reverse=True)
    for name in candidates:
        marker = store.read(store.key(CHECKPOINTS, name, MARKER))
        if marker is not None:
            return name, json.loads(marker)["files"]
    return None


def _restore_checkpoint(store: _Store, name: str, files: dict[str, int], ckpt_root: Path) -> Path:
    """Download under a temporary name, check sizes, rename, then move LATEST (as checkpoint.py does)."""
    tmp = ckpt_root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    for rel, size in files.items():
        _download_listed(store, f"{CHECKPOINTS}/{name}", rel, size, tmp)
    final = ckpt_root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / f".{LATEST}.tmp"
    latest_tmp.write_text(f"{name}\n")
    os.replace(latest_tmp, ckpt_root / LATEST)
    return final


def _download_listed(store: _Store, ckpt_key: str, rel: str, size: int, into: Path) -> None:
    """One file a marker lists: the path must stay inside the checkpoint, the size must match."""
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise ValueError(f"{store.url(store.key(ckpt_key, MARKER))} lists an unsafe path {rel!r}")
    dest = into / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    store.client.download_file(store.bucket, store.key(ckpt_key, rel), str(dest))
    if dest.stat().st_size != size:
        raise OSError(f"{dest}: {dest.stat().st_size} bytes downloaded, the marker says {size}")
