"""Online training: the frozen target computes features every step, the drafter learns.

Reads top to bottom: `Trainer` (optimizer, schedule, and its parts) -> `train_step` -> `run` (the loop:
steps, probes, log lines, checkpoints). `build` (train/build.py) makes a Trainer from a run's config:
topology, target, data, drafter. The parts, one job each: `features` (train/features.py: this rank's
target, or a target rank's messages), `spec` (train/step.py: how a micro-batch is made and computed,
resolved once), `checkpoints` (train/state.py: resume, save, prune, mirror), the probes
(train/probes.py: validation and tau), the metrics (train/metrics.py). The same loop runs on one CPU,
one GPU or many ranks: the Topology says which micro-batches this rank trains on and owns every
collective.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.config import TrainConfig, save_config
from flashdraft.data.packing import PackedLoader
from flashdraft.distributed.exchange import MessageShape, RemoteFeatures, serve_features
from flashdraft.distributed.parallel import (
    clip_divisor,
    gradient_sync,
    parallelize,
    sharding_line,
)
from flashdraft.distributed.topology import Topology
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.target import Target, decoder_layers
from flashdraft.run.fingerprint import ENV_FILE
from flashdraft.run.s3 import S3Mirror
from flashdraft.train.blocks import default_gamma
from flashdraft.train.compile import (
    recompiles_are_errors,
    reset_stance,
    use_cache_dir,
    warm_up,
)
from flashdraft.train.features import LocalFeatures, ReceivedFeatures
from flashdraft.train.flops import matmul_tflops, mfu, micro_batch_flops
from flashdraft.train.mask import MaskChoice
from flashdraft.train.metrics import MetricsLogger, StepStats, Window, peak_memory_bytes
from flashdraft.train.precision import in_bf16, refresh, use_bf16_weights
from flashdraft.train.probes import autocast, measure_tau, sum_over_drafters_, validate
from flashdraft.train.state import Checkpointer, NonFiniteError, write_fingerprint
from flashdraft.train.step import (
    Kernels,
    StepSpec,
    block_visibility,
    micro_step_loss,
    selector_objective,
    target_features,
)
from flashdraft.train.timing import NULL_TIMER, PhaseTimer


def resolve_attention(choice: str, device: torch.device, head_dim: int) -> str:
    """flex on GPU, the dense SDPA reference on CPU, where flex_attention has no backward."""
    if choice == "auto":
        choice = "flex" if device.type == "cuda" else "dense"
    if choice == "flex" and device.type == "cpu":
        raise ValueError("attention=flex cannot train on CPU (flex_attention has no CPU backward); use dense")
    if choice == "flex" and head_dim < 16:  # inductor's flex kernels: "embedding dimension ... at least 16"
        raise ValueError(
            f"flex_attention needs a head size of at least 16, the drafter's is {head_dim}: "
            "set drafter.head_dim (or attention: dense)"
        )
    return choice


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate: linear warmup, then cosine decay to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Interrupted(RuntimeError):
    """Ctrl-C: the run stopped after a whole step, saved; the message names the checkpoint."""


class Preempted(Interrupted):
    """SIGTERM, what a scheduler sends before it kills: the run stopped after a whole step, saved."""


def early_save_step(first: int, startup_s: float, step_s: float) -> int:
    """The step of a process's first checkpoint (`early_save`): once the steps after its first have taken
    as long as its start-up did, and at least one step after the first. `first`: the process's first
    step; `startup_s`: from the process's start to the end of that step (loading, compilation); `step_s`:
    what its second step took."""
    return first + max(1, math.ceil(max(startup_s, 0.0) / max(step_s, 1e-6)))


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    first_loss: float
    checkpoint: Path


def compiles(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether a run compiles: `cfg.compile`, by default on a GPU."""
    return cfg.compile if cfg.compile is not None else device.type == "cuda"


class Trainer:
    """Owns the training state (target, drafter, optimizer, schedule, step) and runs steps."""

    def __init__(
        self,
        cfg: TrainConfig,
        target: Target,
        drafter: DFlashDrafter,
        stream,
        total_steps: int,
        topo: Topology | None = None,
        out_dir: str | Path | None = None,
        meta: dict | None = None,
        resume: bool = False,
        val_loader: PackedLoader | None = None,
        tau_probe: tuple | None = None,
        mirror: S3Mirror | None = None,
        mask: MaskChoice | None = None,
    ):
        """target: taps the drafter's layers; its packing is how the rows of `stream` hold documents
        (`flashdraft.model.target.choose_packing`). A drafter rank of a split layout holds the target's
        embedding and lm_head alone (`load_target(layers=0)`). val_loader: held-out conversations
        (`val_data`); tau_probe: (tokenizer, prompts) for tau during training (`eval_every`); mirror: the
        S3 mirror of the run's checkpoints and files; meta: what the run records of its target and
        data; mask: how the drafter's MASK token was chosen, named on the start-up lines."""
        target.require_taps(drafter.target_layer_ids)
        self.cfg = cfg
        self.topo = topo or Topology(device=next(drafter.parameters()).device)
        self.device = self.topo.device
        self.drafter = drafter
        self.feature_dim = len(drafter.target_layer_ids) * target.config.hidden_size
        self.feature_dtype = target.embed_tokens.weight.dtype
        self.target = target
        if self.topo.is_main:
            print(self.target.describe(), flush=True)
            print(drafter.describe(), flush=True)
            if mask is not None:
                print(mask.describe(), flush=True)
        self.stream = stream
        self.total_steps = total_steps
        self.out = Path(out_dir) if out_dir else None
        self.meta = meta or {}
        self.compiled = compiles(cfg, self.device)
        self.attention = resolve_attention(cfg.attention, self.device, drafter.config.head_dim)
        self.spec = StepSpec(
            Kernels(
                self.attention,
                self.compiled,
                cfg.recompute_logits,
                cfg.distill,
                cfg.dpace_alpha if cfg.position_weights == "dpace" else None,
                selector_objective(cfg.selector, drafter),
            ),
            cfg.num_anchors,
            drafter.block_size,
            drafter.mask_token_id,
            cfg.gamma or default_gamma(cfg.drafter.block_size),
            cfg.anchors_per_document,
            cfg.seed,
            cfg.grad_accum,
            self.topo.num_drafters,
        )
        self.compile_report = None
        if cfg.compile_target and not self.compiled:
            raise ValueError("compile_target needs compile (on by default on GPU; set compile: true)")
        self.compile_target = self.compiled if cfg.compile_target is None else cfg.compile_target
        self.cache_dir = use_cache_dir(None, self.device) if self.compiled else None
        self.bf16_linears = []  # train.bf16_weights: what the optimizer step refreshes
        with autocast(self.device):
            drafter_in_bf16 = in_bf16(self.device.type)
        if cfg.bf16_weights and not drafter_in_bf16:
            raise ValueError(
                f"bf16_weights: the drafter computes in fp32 on {self.device.type}, so its weights "
                "have no bf16 copies to keep; drop bf16_weights (it needs a GPU)"
            )
        if cfg.bf16_weights or (cfg.bf16_weights is None and drafter_in_bf16 and not cfg.fsdp):
            self.bf16_linears = use_bf16_weights(drafter)  # before the compile and the optimizer
        if self.compiled:
            # the two norms outside the layers too (the final one, and the context's after fc): eager,
            # their fp32 element-wise kernels took about 3.5 ms of a qwen3-8b step (H200 profile)
            for module in (*drafter.layers, drafter.norm, drafter.hidden_norm):
                module.compile(dynamic=False)
            if self.compile_target and self.topo.is_target:
                # forward only: the tap hooks stay eager; decoding (tau) runs eagerly anyway
                for layer in decoder_layers(self.target.model)[2]:
                    layer.forward = torch.compile(layer.forward, dynamic=False)
        self.model = parallelize(drafter, self.topo, cfg.fsdp)
        if cfg.fsdp and self.topo.is_main:
            print(sharding_line(drafter), flush=True)
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
            fused=True,  # on the device: skips a step when found_inf is set, clips by grad_scale
        )
        warmup = round(cfg.optim.warmup_ratio * total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_lr(s, total_steps, warmup, cfg.optim.min_lr_ratio)
        )
        self.flops_per_micro = micro_batch_flops(cfg, target.whole_config, drafter.config)
        self.peak_tflops: float | None = None  # measured at the start of run() on the main rank
        self.peak_fp8_tflops: float | None = None  # and the FP8 rate, with target_fp8
        self.step = 0
        self.bad_run = torch.zeros((), dtype=torch.long, device=self.device)  # consecutive skipped steps
        self.skipped = torch.zeros((), dtype=torch.long, device=self.device)
        self.tau_probe = tau_probe
        self.pending: dict = {}  # measured at a step, logged with that step's (or the next) line
        self.val_loader = val_loader
        self.last_metrics: dict = {}
        self.checkpoints = Checkpointer(
            cfg, self.topo, self.out, drafter, self.optimizer, self.scheduler, self.spec.micro_per_step,
            self.compiled, self.cache_dir, mirror,
        )  # fmt: skip
        self.remote = None  # a drafter rank of a split layout: the features it receives
        if self.topo.layout.is_split and self.topo.is_drafter:
            self.remote = RemoteFeatures(self.topo, self.message_shape(), cfg.grad_accum)
        if self.remote:
            self.features = ReceivedFeatures(self.remote)
        else:
            self.features = LocalFeatures(stream, target, self.device, final=self.spec.kernels.distill > 0)
        # The next step's first micro-batch goes through the target at the end of a step, after the
        # optimizer is launched (the target reads nothing the optimizer writes), and that micro-batch's
        # block mask is built on the host while the GPU runs it. One process on a GPU runs the optimizer
        # on a stream of its own, so that the target's matmuls fill the GPU beside its memory-bound
        # kernels; elsewhere the two run in turn.
        self.prefetch = not self.remote
        alone = self.topo.world_size == 1 and self.device.type == "cuda"
        self.update_stream = torch.cuda.Stream(self.device) if alone and self.prefetch else None
        self.ahead: tuple | None = None  # (global micro-batch, what _micro_batch gave) of the next step
        if resume:
            self.step = self.checkpoints.resume()

    def save(self) -> Path | None:
        """A checkpoint of this step (Checkpointer.save): the main rank's path, None on the others."""
        return self.checkpoints.save(self.step, self.fingerprint_extra())

    def message_shape(self) -> MessageShape:
        return MessageShape(
            self.cfg.data.rows_per_batch, self.cfg.data.seq_len, self.feature_dim, self.feature_dtype
        )

    def micro_indices(self, step: int) -> list[int]:
        """Global micro-batches this drafter rank trains on at `step` (1-based)."""
        base = (step - 1) * self.spec.micro_per_step
        return [
            base + g * self.topo.num_drafters + self.topo.drafter_rank for g in range(self.cfg.grad_accum)
        ]

    def _micro_batch(self, m: int, next_m: int | None, timer: PhaseTimer):
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == m:
            return ahead[1]
        batch, feats, teacher, ctx_tokens = self.features.get(m, next_m, timer)
        return self.spec.plan(batch, m, feats, teacher), ctx_tokens

    def train_step(self, timer: PhaseTimer = NULL_TIMER) -> StepStats:
        """One optimizer step over this rank's micro-batches; returns device tensors (no host sync). Unless
        it is the last, the step ends with the target forward of the next step's first micro-batch."""
        cfg = self.cfg
        step = self.step + 1
        indices = self.micro_indices(step)
        following = self.micro_indices(step + 1)[0] if step < self.total_steps else None
        planned = [
            self._micro_batch(m, indices[i + 1] if i + 1 < len(indices) else following, timer)
            for i, m in enumerate(indices)
        ]
        micro = [mb for mb, _ in planned]
        # the loss is normalised by the weight sum of the whole global step, over every rank
        weight_sum = self.topo.drafter_sum_(sum(mb.blocks.weights.sum() for mb in micro)).clamp(min=1e-6)
        scale = self.topo.num_drafters  # DDP and FSDP2 average gradients over drafter ranks
        stats = StepStats.zeros(self.drafter.block_size, self.device)
        stats.ctx_tokens = sum(n for _, n in planned)
        for i, mb in enumerate(micro):
            with gradient_sync(self.model, enabled=i == len(micro) - 1):
                with autocast(self.device):
                    out = micro_step_loss(self.model, self.target, mb, self.spec.kernels, timer, step)
                with timer("backward"):
                    (out.weighted_ce * scale / weight_sum).backward()
            stats.add(out, mb)
        update = self.update_stream
        if update is not None:  # the gradients are the backward's, on the main stream
            update.wait_stream(torch.cuda.current_stream(self.device))
        on_update = torch.cuda.stream(update) if update is not None else contextlib.nullcontext()
        with on_update, timer("optimizer"):
            # clipped inside fused AdamW's own kernel: it divides the gradients by its grad_scale
            stats.grad_norm, self.optimizer.grad_scale = clip_divisor(
                self.drafter.parameters(), cfg.optim.grad_clip
            )
            # a non-finite loss or gradient skips the update on the device, with no host sync;
            # the host reads the count at log and save steps
            bad = ~torch.isfinite(stats.grad_norm)
            self.optimizer.found_inf = bad.float()
            self.bad_run = (self.bad_run + 1) * bad
            self.skipped += bad
            self.optimizer.step()
            refresh(self.bf16_linears)
        if self.prefetch and following is not None:
            ahead = self._micro_batch(following, None, timer)
            with timer("block_mask"):  # host work, while the GPU runs that target forward
                ahead[0].visibility = block_visibility(self.drafter, ahead[0], self.spec.kernels)
            self.ahead = (following, ahead)
        if update is not None:  # the step ends with the weights updated, whoever reads them next
            torch.cuda.current_stream(self.device).wait_stream(update)
        self.optimizer.zero_grad(set_to_none=True)  # after the wait: the optimizer has read them
        self.scheduler.step()
        stats.weight_sum = weight_sum
        self.step = step
        return stats

    def step_loss(self, stats: StepStats) -> float:
        """A step's training loss over every drafter rank (a collective: each drafter rank asks)."""
        return float(self.topo.drafter_sum_(stats.loss_sum.clone()) / stats.weight_sum)

    def train_step_guarded(self, timer: PhaseTimer = NULL_TIMER) -> StepStats:
        """train_step; the first compiled one is the warm-up, after which recompiling is an error."""
        if not self.compiled:
            return self.train_step(timer)
        if self.compile_report is None:
            out: list[StepStats] = []
            self.compile_report = warm_up(
                lambda: out.append(self.train_step(timer)), self.cache_dir, self.checkpoints.artifacts_loaded
            )
            print(f"[rank {self.topo.rank}] {self.compile_report.line()}", flush=True)
            return out[0]
        with recompiles_are_errors():
            return self.train_step(timer)

    def serve(self, until: int) -> None:
        """Target rank of a split layout: compute and send features for every step up to `until`."""
        per_step = self.spec.micro_per_step
        start = self.step * per_step
        feats = lambda batch, plain: target_features(self.target, batch, plain)  # noqa: E731
        serve_features(self.topo, feats, self.stream, until * per_step, self.message_shape(), start)

    def run(
        self,
        progress=None,
        until: int | None = None,
        deadline: float | None = None,
        started: float | None = None,
    ) -> TrainResult | None:
        """Train to `total_steps`; checkpoints every `save_every` steps and at the end (main rank).

        until: stop after this step instead, with a checkpoint that `--resume` continues from (a slice of
        the run, for allocations shorter than the run); the schedule stays that of `total_steps`.
        deadline: a `time.time()` after which the run stops the same way, after the step (and its probe)
        in progress: a slice that ends on the clock rather than on a step count estimated from a timed
        step, whose estimate can run past the allocation before the slice saves. One process only: ranks
        would pass the deadline at different steps.
        started: the `time.time()` at which the process began to start up (`flashdraft train` gives it):
        with `early_save`, its first checkpoint comes once the steps after its first have taken as long as
        that start-up (`early_save_step`). None: no early checkpoint.
        Ctrl-C or SIGTERM in a run of one process stops it after the step in progress with a checkpoint:
        Interrupted, or Preempted for SIGTERM."""
        self.check_slice(until, deadline)
        until = until or self.total_steps  # a run resumed at its end saves and reports again
        if not self.topo.is_drafter:
            self.serve(until)
            return None
        if self.device.type == "cuda":  # mem_gib is this run's peak, not that of what the process did first
            torch.cuda.reset_peak_memory_stats()
        try:
            return self._run(progress, until, deadline, started if self.cfg.early_save else None)
        finally:
            if self.compiled:
                reset_stance()

    def check_slice(self, until: int | None, deadline: float | None) -> None:
        """ValueError unless `run(until=..., deadline=...)` can run that slice of this run."""
        if until is not None and not self.step < until <= self.total_steps:
            raise ValueError(f"until={until}: must lie after step {self.step} and by {self.total_steps}")
        if deadline is not None and self.topo.world_size > 1:
            raise ValueError(
                f"a run of {self.topo.world_size} processes cannot stop on the clock (its ranks would stop "
                "at different steps): give it a step to stop at instead"
            )

    def _run(self, progress, until: int, deadline: float | None, started: float | None) -> TrainResult:
        cfg = self.cfg
        main = self.topo.is_main
        log = None
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.checkpoints.start()
            save_config(cfg, self.out / "config.yaml", record={**self.meta, "layout": str(self.topo.layout)})
            write_fingerprint(self.out / ENV_FILE, self.fingerprint_extra())
            wandb_config = cfg.model_dump(mode="json") if cfg.wandb else None
            log = MetricsLogger(self.out, self.total_steps, start_step=self.step, wandb_config=wandb_config)
            self.peak_tflops = matmul_tflops(self.device)
            self.peak_fp8_tflops = matmul_tflops(self.device, fp8=True) if cfg.target_fp8 else None
        first = last = float("nan")
        window = Window(self.device)
        first_step, first_done, early = self.step + 1, 0.0, None  # early: the early checkpoint's step
        saved = False  # whether this process has written a checkpoint
        with self._stop_on_interrupt() as interrupted:
            while self.step < until:
                stats = self.train_step_guarded()
                step = self.step
                window.add(stats)
                late = deadline is not None and time.time() >= deadline and step < until
                if started is not None and step == first_step:
                    first_done = time.time()
                elif started is not None and step == first_step + 1:  # the drafter ranks agree on it
                    at = early_save_step(first_step, first_done - started, time.time() - first_done)
                    early = int(self.topo.drafter_max(float(at)))
                if step == 1:
                    first = self.step_loss(stats)
                if self.tau_probe is not None and (step % cfg.eval_every == 0 or step == self.total_steps):
                    self.pending |= self.measure_tau()
                if self.val_loader is not None and (
                    (cfg.val_every and step % cfg.val_every == 0) or step == self.total_steps
                ):
                    self.pending |= self.validate()
                if step % cfg.log_every == 0 or step in (until, self.total_steps) or late:
                    m = self._metrics(stats, window)
                    last = m["loss"]
                    if main:
                        log.log(m)
                        if progress is not None:
                            progress(step, self.total_steps, m["loss"])
                    window = Window(self.device, self.remote.wait_s if self.remote else 0.0)
                periodic = cfg.save_every and step % cfg.save_every == 0
                saving = (periodic or (step == early and not saved)) and step < until  # else saved below
                stop = interrupted() is not None and step != self.total_steps
                if saving or step % cfg.log_every == 0 or stop:
                    self._check_finite()
                if late and not stop:  # saved below
                    break
                if saving or stop:
                    path, saved = self.save(), True
                    stop = interrupted() is not None and step != self.total_steps  # or during the save
                if stop:
                    if main:
                        log.close()
                    raise self._stopped(interrupted(), step, path, self.checkpoints.wait_for_mirror())
            ckpt = self.save()  # a signal now lets it finish: the run (or its slice) is then complete
        if self.step < self.total_steps:
            if main:
                log.close()
            return TrainResult(self.step, last, first, ckpt)
        if main:
            log.close()
            finite = {
                k: v if math.isfinite(v) else None for k, v in (("first_loss", first), ("final_loss", last))
            }
            (self.out / "result.json").write_text(json.dumps({"steps": self.total_steps, **finite}))
            self.checkpoints.finish()
        return TrainResult(self.total_steps, last, first, ckpt)

    def _stopped(self, signum: int, step: int, path: Path | None, unmirrored: list[str]) -> Interrupted:
        """What stops the run after a signal: `unmirrored`, what of an S3 mirror did not complete."""
        mirror = f" (the S3 mirror is not complete: {'; '.join(unmirrored)})" if unmirrored else ""
        if signum == signal.SIGTERM:
            return Preempted(
                f"preempted (SIGTERM) after step {step}: saved {path}{mirror}; the same command with "
                f"--auto-resume (or --resume {self.out}) continues"
            )
        return Interrupted(
            f"interrupted after step {step}: saved {path}{mirror}; --resume {self.out} continues"
        )

    @contextlib.contextmanager
    def _stop_on_interrupt(self):
        """In a one-process run, Ctrl-C or SIGTERM asks the loop to stop after the step it is in, save,
        and raise Interrupted (Preempted for SIGTERM; the first signal decides which). A second Ctrl-C
        stops at once (KeyboardInterrupt); a second SIGTERM changes nothing: schedulers and the scripts
        around a run often deliver one twice, and SIGKILL is their way to stop at once. A run of several
        ranks keeps the handlers it had (its ranks would not stop at the same step): its last
        checkpoint is what it resumes from. The context gives a function that returns the first signal
        asked, or None."""
        asked: list[int] = []
        in_main = threading.current_thread() is threading.main_thread()
        if self.topo.world_size > 1 or not in_main:
            yield lambda: None
            return
        # a process started with a signal ignored (SIGINT in a shell's background job) keeps ignoring it
        caught = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]

        def put_back(s: int) -> None:
            signal.signal(s, signal.SIG_DFL if previous[s] is None else previous[s])

        def handler(signum, frame):
            if signal.SIGINT in caught:
                put_back(signal.SIGINT)
            if asked:
                return
            asked.append(signum)
            what, again = (
                ("interrupted", "Ctrl-C again") if signum == signal.SIGINT else ("SIGTERM", "Ctrl-C")
            )
            print(f"\n{what}: stopping after this step, then saving ({again} stops at once)", flush=True)

        previous = {s: signal.signal(s, handler) for s in caught}
        try:
            yield lambda: asked[0] if asked else None
        finally:
            for s in caught:
                put_back(s)

    def _metrics(self, stats: StepStats, window: Window) -> dict:
        """The log line's numbers: the step's loss and accuracy, the window's rates (all ranks)."""
        sum_over_drafters_(stats, self.topo)  # at log steps only
        totals = torch.stack([window.positions, window.positions.new_tensor(float(window.tokens))])
        positions, tokens = self.topo.drafter_sum_(totals).tolist()
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        micro = self.spec.micro_per_step * window.steps
        done = {k: v * micro for k, v in self.flops_per_micro.items()}
        m = stats.to_metrics()
        m.update(
            step=self.step,
            lr=self.scheduler.get_last_lr()[0],
            ctx_tok_s=tokens / elapsed,
            draft_pos_s=positions / elapsed,
            mfu=mfu(done, elapsed, self.peak_tflops, self.peak_fp8_tflops, self.topo.world_size)
            if self.peak_tflops  # the main rank's
            else 0.0,
            mem_gib=peak_memory_bytes(self.device) / 2**30,
            skipped_steps=int(self.skipped),
        )
        if self.remote is not None:
            m["drafter_busy"] = 1 - self.topo.drafter_max(self.remote.wait_s - window.wait_s) / elapsed
            m["target_busy"] = self.remote.target_busy
        m.update(self.pending)
        self.pending = {}
        self.last_metrics = m
        return m

    def close(self) -> None:
        """Release the DDP wrapper before the process group: a gloo group destroyed while DDP's
        reducer still holds it hangs in the reducer's destructor at exit."""
        self.model = self.drafter
        gc.collect()
        self.topo.close()

    def _check_finite(self) -> None:
        """Stop after `max_bad_steps` consecutive non-finite steps, saving the last good state (skipped
        steps change neither weights nor optimizer state, so the current state is the last good one)."""
        run = int(self.topo.drafter_sum_(self.bad_run.clone()))
        if run >= self.cfg.max_bad_steps:
            path = self.save()
            raise NonFiniteError(
                f"{run} consecutive steps up to step {self.step} had a non-finite loss or gradient and "
                f"were skipped; stopped. The last good weights are saved in {path}. Lower optim.lr or "
                "check the data."
            )

    def validate(self) -> dict:
        """The training metrics on held-out conversations (train/probes.py `validate`)."""
        warmed_up = self.compile_report is not None
        return validate(
            self.val_loader, self.cfg.val_batches, self.drafter, self.target, self.spec, self.topo, warmed_up
        )

    def measure_tau(self) -> dict:
        """Greedy tau on held-out prompts against the running target (train/probes.py `measure_tau`)."""
        tokenizer, prompts = self.tau_probe
        new_tokens, graphs = self.cfg.eval_max_new_tokens, self.cfg.eval_cuda_graphs
        return measure_tau(tokenizer, prompts, self.drafter, self.target, self.device, new_tokens, graphs)

    def fingerprint_extra(self) -> dict:
        """The run's speed so far, recorded in RUN/env.json and with every checkpoint."""
        keys = ("step", "ctx_tok_s", "draft_pos_s", "loss")
        return {"throughput": {k: self.last_metrics[k] for k in keys if k in self.last_metrics}}
