"""The `flashdraft` command: thin entry points that validate options, build, run and close."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(
    help="Train DFlash block-diffusion drafters for speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def train(
    target: str = typer.Option(..., help="target model: local HF directory or hub id"),
    data: Path = typer.Option(..., help="token dataset directory (from `flashdraft data prepare`)"),
    out: Path = typer.Option(..., help="run directory"),
    config: Path | None = typer.Option(None, help="YAML config overlaid on the preset"),
    preset: str = typer.Option("default", help="named preset: default, tiny_cpu, qwen3_8b_h200"),
    max_steps: int | None = typer.Option(None, help="stop after this many optimizer steps"),
    save_every: int | None = typer.Option(None, help="checkpoint every N steps (and at the end)"),
    seed: int | None = typer.Option(None, help="random seed"),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda when visible)"),
) -> None:
    """Online training: the frozen target computes features each step, the drafter learns from them."""
    from flashdraft.config import resolve_config
    from flashdraft.train.trainer import Trainer

    try:
        cfg = resolve_config(preset, config, max_steps=max_steps, save_every=save_every, seed=seed)
        trainer = Trainer(cfg, target, str(data), str(out), device=device)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    result = trainer.run(save_every=cfg.save_every, progress=_print_progress(cfg.log_every))
    typer.echo(
        f"done: {result.steps} steps, loss {result.first_loss:.4f} -> {result.final_loss:.4f}; "
        f"checkpoint {result.checkpoint}"
    )


def _print_progress(every: int):
    def show(step: int, total: int, loss: float) -> None:
        if step % every == 0 or step == total:
            typer.echo(f"step {step}/{total} loss {loss:.4f}", err=sys.stderr.isatty())

    return show


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), help="where the demo writes its target, data and run"),
    minutes: float = typer.Option(8.0, help="rough time budget on a 2-core CPU"),
) -> None:
    """The embedded default: the whole pipeline on CPU on a tiny target it trains itself."""
    from flashdraft.demo.pipeline import run_demo

    run_demo(out, budget_minutes=minutes)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
