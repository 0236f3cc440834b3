"""A run's checkpoints: the trainer state saved beside the z-lab weights, so `--resume` continues
exactly where a run stopped, and the `Checkpointer`, which owns them (resume from the newest readable
one, save complete or absent and only when finite, prune, mirror to S3).

trainer_state.pt holds the step, the fp32 master weights (the z-lab file is bf16), the optimizer
and scheduler states and the config it ran with: plain tensors and containers, loaded with
`torch.load(weights_only=True)`, which executes no pickled code. The data position and the anchor
RNG are pure functions of the step (see MicroBatchStream and row_generators), so nothing else is
needed to continue bit for bit.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from flashdraft.config import TrainConfig
from flashdraft.distributed.parallel import full_state, load_full_state
from flashdraft.distributed.topology import Topology
from flashdraft.model.checkpoint import (
    latest_checkpoint,
    prune_checkpoints,
    remove_partial_checkpoints,
    save_checkpoint,
)
from flashdraft.run.fingerprint import ENV_FILE, fingerprint
from flashdraft.run.s3 import S3Mirror
from flashdraft.train.compile import ARTIFACTS, artifacts_writer, load_artifacts

STATE = "trainer_state.pt"
log = logging.getLogger(__name__)

# Fields that change what the step computes or which data it sees: a resume must keep them.
_FIXED = [
    "drafter",
    "data.seq_len",
    "data.rows_per_batch",
    "num_anchors",
    "anchors_per_document",
    "gamma",
    "seed",
    "epochs",
    "attention",
]


def trainer_state_writer(
    step: int,
    micro_per_step: int,
    weights: dict,
    optimizer: dict,
    scheduler: LRScheduler,
    cfg: TrainConfig,
):
    """weights, optimizer: the drafter's and optimizer's full state (dist.parallel.full_state)."""

    def write(path: Path) -> None:
        state = {
            "step": step,
            "micro_per_step": micro_per_step,
            "master": {k: v.detach().cpu() for k, v in weights.items()},
            "optimizer": optimizer,
            "scheduler": scheduler.state_dict(),
            "config": cfg.model_dump(mode="json"),
        }
        torch.save(state, path)

    return write


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def check_resumable(saved: dict, cfg: TrainConfig, micro_per_step: int, where: Path) -> None:
    now = cfg.model_dump(mode="json")
    changed = [k for k in _FIXED if _get(saved["config"], k) != _get(now, k)]
    if changed:
        details = "; ".join(f"{k}: {_get(saved['config'], k)} -> {_get(now, k)}" for k in changed)
        raise ValueError(f"cannot resume from {where}: the run changed {details}")
    if saved["micro_per_step"] != micro_per_step:
        raise ValueError(
            f"cannot resume from {where}: it ran {saved['micro_per_step']} micro-batches per step "
            f"(grad_accum x drafter ranks), this run has {micro_per_step}; keep the global batch"
        )
    changeable = ("optim", "distill", "max_steps", "log_every", "save_every", "keep_last", "eval_every")
    for key in (*changeable, "eval_prompts"):
        if saved["config"].get(key) != now.get(key):
            log.warning("resume: %s changed from %s to %s", key, saved["config"].get(key), now.get(key))


def load_trainer_state(
    ckpt: Path,
    cfg: TrainConfig,
    micro_per_step: int,
    drafter: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
) -> int:
    """Restore weights, optimizer and schedule from checkpoint `ckpt`; returns its step."""
    path = Path(ckpt) / STATE
    if not path.exists():
        raise ValueError(f"cannot resume from {ckpt}: no {STATE} (an export, not a training checkpoint?)")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    check_resumable(saved, cfg, micro_per_step, ckpt)
    load_full_state(drafter, optimizer, saved["master"], saved["optimizer"])
    for group in optimizer.param_groups:  # a changed learning rate applies from here on
        group["initial_lr"] = cfg.optim.lr
    scheduler.base_lrs = [cfg.optim.lr for _ in scheduler.base_lrs]
    scheduler.load_state_dict({**saved["scheduler"], "base_lrs": scheduler.base_lrs})
    return int(saved["step"])


class NonFiniteError(RuntimeError):
    pass


class MirrorIncomplete(RuntimeError):
    """The run finished, but its S3 mirror did not."""


RUN_FILES = ("config.yaml", ENV_FILE, "metrics.jsonl", "train.log")


class Checkpointer:
    """RUN/checkpoints of a run's drafter, optimizer and schedule: `resume` restores the newest readable
    checkpoint into them, `save` writes one (complete or absent, refused when not finite), prunes beyond
    `keep_last` and mirrors to S3 (`mirror`: an S3Mirror, when the run has one); `finish` waits for the
    mirror."""

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        out: Path | None,
        drafter: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        micro_per_step: int,
        compiled: bool,
        cache_dir: Path | None = None,
        mirror: S3Mirror | None = None,
    ):
        self.cfg, self.topo, self.out, self.compiled, self.cache_dir = cfg, topo, out, compiled, cache_dir
        self.drafter, self.optimizer, self.scheduler = drafter, optimizer, scheduler
        self.micro_per_step = micro_per_step
        self.mirror = mirror
        self.artifacts_loaded = False  # compile artifacts restored from the checkpoint resumed

    def resume(self) -> int:
        """Restore the newest readable checkpoint (the one before it when it is damaged); returns its
        step."""
        root = self.out / "checkpoints" if self.out else None
        ckpt = latest_checkpoint(root) if root else None
        if ckpt is None:
            raise ValueError(
                f"--resume: {self.out}/checkpoints has no complete checkpoint (no LATEST): the run stopped "
                "before its first save; --out with --overwrite starts it again"
            )
        older = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name < ckpt.name), reverse=True)
        for candidate in [ckpt, *older]:  # a checkpoint damaged after it was written: the one before it
            try:
                step = load_trainer_state(
                    candidate, self.cfg, self.micro_per_step, self.drafter, self.optimizer, self.scheduler
                )
                break
            except (RuntimeError, EOFError, OSError, KeyError, pickle.UnpicklingError) as e:
                if self.topo.is_main:
                    print(f"resume: {candidate / STATE} is unreadable ({type(e).__name__}): trying the one "
                          "before it", flush=True)  # fmt: skip
        else:
            raise ValueError(f"--resume: no checkpoint of {root} could be read")
        ckpt = candidate
        if self.topo.is_main:
            forget_metrics_after(self.out / "metrics.jsonl", step)
            forget_log_after(self.out / "train.log", step)
        if self.compiled and (ckpt / ARTIFACTS).exists():
            if self.cfg.trust_compile_cache:
                self.artifacts_loaded = load_artifacts(ckpt)
            elif self.topo.is_main:
                print(
                    f"resume: {ckpt / ARTIFACTS} is not loaded: compile artifacts are pickles, which run "
                    "code when loaded (--trust-compile-cache loads them, for a run you trust); compiling "
                    f"again, with the local cache in {self.cache_dir}",
                    flush=True,
                )
        return step

    def start(self) -> None:
        """The main rank, before the first step: no half-written checkpoint left by a kill."""
        remove_partial_checkpoints(self.out / "checkpoints")

    def save(self, step: int, throughput: dict) -> Path | None:
        """Checkpoint `step` on the main rank (complete or absent); every drafter rank takes part in
        gathering a sharded drafter's state and waits for the checkpoint. `throughput`: the fingerprint's
        extra record of the run's speed so far.

        Older checkpoints beyond `keep_last` are pruned once this one is complete, and with an S3
        mirror only once this one's upload is confirmed.
        """
        path = None
        self._refuse_non_finite_state(step)
        weights, optim = full_state(self.drafter, self.optimizer, keep=self.topo.is_main)
        if self.topo.is_main:
            state = trainer_state_writer(step, self.micro_per_step, weights, optim, self.scheduler, self.cfg)
            extra = {STATE: state, ENV_FILE: lambda p: write_fingerprint(p, throughput)}
            if self.compiled:
                extra[ARTIFACTS] = artifacts_writer()
            root = self.out / "checkpoints"
            path = save_checkpoint(self.drafter, root, step, extra, weights)
            keep = self.cfg.keep_last
            if self.mirror is not None:
                prune = (lambda done: prune_checkpoints(root, keep, protect=done)) if keep else None
                self.mirror.submit_dir(path, f"checkpoints/{path.name}", on_done=prune)
                self.mirror_run_files()
            elif keep:
                prune_checkpoints(root, keep)
        self.topo.drafter_barrier()
        return path

    def _refuse_non_finite_state(self, step: int) -> None:
        """No checkpoint holds a NaN or an infinity, and none such prunes an older one: a weight or an
        optimizer moment that is not finite (on any drafter rank, in any shard) stops the run here."""
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.drafter.parameters()]
        for state in self.optimizer.state.values():
            local += [
                v.to_local() if isinstance(v, DTensor) else v for v in state.values() if torch.is_tensor(v)
            ]
        bad = torch.stack([~torch.isfinite(t.detach()).all() for t in local]).any().float()
        if float(self.topo.drafter_sum_(bad)) > 0:
            last = latest_checkpoint(self.out / "checkpoints") if self.out else None
            raise NonFiniteError(
                f"step {step}: the drafter's weights or optimizer state hold NaN or infinity, so "
                f"no checkpoint is written; the last checkpoint, all finite: {last or 'none'}. Lower "
                "optim.lr or check the data."
            )

    def mirror_run_files(self) -> None:
        for name in RUN_FILES:
            if (self.out / name).exists():
                self.mirror.submit_file(self.out / name, name)

    def finish(self) -> None:
        """Wait at most `s3_wait_s` for the uploads; a mirror that did not complete is an error naming
        what is missing (the run directory itself is whole)."""
        missing = self.wait_for_mirror()
        if missing:
            raise MirrorIncomplete(
                f"the S3 mirror is not complete; everything is in {self.out}, but: " + "; ".join(missing)
            )

    def wait_for_mirror(self) -> list[str]:
        """Submit the run files once more, then wait at most `s3_wait_s` for every upload: at the end of
        a run, and when a signal stops it, so that the checkpoint just written reaches the bucket before
        the machine (and its disk) goes. Returns what did not complete (empty: all did, or no mirror)."""
        if self.mirror is None:
            return []
        if not self.mirror.closed:
            self.mirror_run_files()
        wait = self.cfg.s3_wait_s
        finished = self.mirror.close(timeout=wait)
        missing = list(self.mirror.failed)
        if not finished:
            missing.append(f"{self.mirror.pending()} uploads still queued after {wait:g} s (s3_wait_s)")
        return missing


def write_fingerprint(path: Path, extra: dict) -> None:
    Path(path).write_text(json.dumps(fingerprint(extra=extra), indent=1, sort_keys=True))


def forget_metrics_after(path: Path, step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: drop their old metric lines."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True) if _metric_step(line) <= step]
    path.write_text("".join(kept))


def forget_log_after(path: Path, step: int) -> None:
    """train.log's lines of the steps a resumed run redoes ("step N/T ..."), dropped like their metrics."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not ((m := _LOG_STEP.match(line)) and int(m.group(1)) > step)]
    path.write_text("".join(kept))


_LOG_STEP = re.compile(r"step (\d+)/")


def _metric_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 1 << 62  # a line torn by a kill is dropped
