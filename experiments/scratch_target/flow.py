"""The proof on a target trained here (experiments/scratch_target/proof.py): the demo's flow at GPU scale,
with the drafter trained by `flashdraft train`, T = 0 and T = 1, the reference package, and ablations.

The main flow, inside the time budget:
1. `prepare` (flashdraft.demo.pipeline): tokenizer + Qwen3 target trained on real code, held-out
   prompts, conversations the target rewrites greedily, token shards;
2. the main drafter (5 tapped layers) trained alone on the GPU by a `flashdraft train` subprocess,
   with tau on the held-out prompts halfway and at the end;
3. `compare_methods` (flashdraft eval) at T = 0: DFlash, n-gram and plain decoding on the held-out
   prompts; the drafter exported to the z-lab layout and decoded by the reference `dflash` package;
   the same comparison at T = 1.
With ablations=True: the same drafter tapping only the token embedding (no target features) and
tapping 3 layers, trained at the same time as the main one (one start-up for all three, ~60 s on a
cold H200) for as many steps, and their greedy tau. They are planned into the same time budget
(fewer steps for all), so that one run of the budget measures them all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table

from flashdraft.config import set_dotted
from flashdraft.demo.pipeline import Scale, StageClock, prepare
from flashdraft.eval.reference import reference_beside_ours

# The drafter both H200 proofs train (3 layers, 5 taps, 8 rows of 2,048 tokens, 256 anchors a row)
H200_DRAFTER = {
    "drafter.num_layers": 3,
    "drafter.num_taps": 5,
    "data.seq_len": 2048,
    "data.rows_per_batch": 8,
    "num_anchors": 256,
    "optim.lr": 1e-3,
}

# The proof's scale on one H200; the measurements behind its figures are in docs/results.md.
H200 = Scale(
    device="cuda",
    vocab_size=8192,
    target=dict(hidden=768, layers=12, heads=12, kv_heads=4),
    target_batch=128,  # compiled layers: 592K tokens/s at 128 rows (experiments/studies/proof_stages.py)
    target_lr=1e-3,
    target_compile=True,
    prompt_tokens=64,
    response_tokens=128,
    conversations=98304,  # 12 batches of 8,192, of which 2,048 held out for validation
    val_conversations=2048,
    regen_batch=8192,
    regen_cache="static",
    prepare_procs=8,
    drafter={**H200_DRAFTER, "eval_cuda_graphs": True},  # the probes on CUDA graphs, as the evals
    preset="default",
    drafter_step_s=0.043,  # median step at 8 rows in `flashdraft train`
    proof_eval_s=75.0,  # evals at T = 0 and T = 1 and the reference package, 32 prompts, CUDA graphs
    drafter_startup_s=60.0,  # the drafter stage less its steps: start, compile, two probes
    ablation_step_s=0.086,  # what the two ablations add to a step when they train with the main drafter
    ablation_eval_s=20.0,
    cuda_graphs=True,
    eval_prompts=32,
    probe_prompts=12,  # tau during training (CUDA graphs) and the reference package (dynamic caches)
    target_share=0.14,
    drafter_share=0.5,
    source_bytes=160_000_000,
    prompt_tenths=5,  # of every 10 source files, 5 give the drafter's prompts
)

# name -> config overrides on top of the scale's drafter; "main" is the proof, the others ablations
VARIANTS: dict[str, dict] = {
    "main": {},  # 5 tapped layers (H200: [1, 3, 5, 7, 9])
    "no_target_features": {"drafter.target_layer_ids": [-1]},
    "taps_3": {"drafter.num_taps": 3},
}


# the same flow with tiny shapes on a CPU (about 2 minutes): checks the flow, proves nothing
SMOKE = dataclasses.replace(
    H200,
    device="cpu",
    vocab_size=512,
    target=dict(hidden=64, layers=8, heads=4, kv_heads=2),
    target_batch=8,
    target_compile=False,  # compiling took 1-23 s of a 1-minute budget by the state of the cache
    target_share=0.3,
    conversations=64,
    val_conversations=16,
    regen_batch=32,
    prepare_procs=1,
    response_tokens=32,
    drafter={"drafter.num_layers": 1, "drafter.num_taps": 5, "data.seq_len": 512, "num_anchors": 32},
    drafter_step_s=1.0,
    ablation_step_s=1.5,
    ablation_eval_s=10.0,
    proof_eval_s=20.0,
    drafter_startup_s=10.0,
    eval_prompts=4,
    probe_prompts=3,
    source_bytes=3_000_000,
)


@dataclass
class DrafterRun:
    name: str
    run_dir: Path
    process: subprocess.Popen
    log: Path


def start_drafter(
    name: str,
    target_dir: Path,
    data_dir: Path,
    out: Path,
    scale: Scale,
    steps: int,
    extra: dict,
    prompts: Path | None = None,
    val_dir: Path | None = None,
) -> DrafterRun:
    """`flashdraft train` in a subprocess; with `prompts`, tau on the first scale.probe_prompts of them
    halfway and at the end; with `val_dir`, the training metrics on its conversations 5 times."""
    run_dir = out / "runs" / name
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_every = 25
    config = {**scale.drafter, **extra, "log_every": log_every}
    cmd = [sys.executable, "-m", "flashdraft.cli.main", "train", "--target", str(target_dir)]
    cmd += ["--data", str(data_dir), "--out", str(run_dir), "--preset", scale.preset]
    cmd += [
        "--device",
        scale.device,
        "--max-steps",
        str(steps),
        "--overwrite",
    ]  # a stage redone starts afresh
    if prompts is not None:
        config |= {"eval_num_prompts": scale.probe_prompts, "eval_max_new_tokens": scale.response_tokens}
        every = log_every * max(1, -(-steps // (2 * log_every)))  # halfway; the last step probes anyway
        cmd += ["--eval-prompts", str(prompts), "--eval-every", str(every)]
    if val_dir is not None:  # 5 times; 8 micro-batches a time: ~600 conversations at the H200 scale
        config["val_batches"] = 8
        every = log_every * max(1, -(-steps // (5 * log_every)))
        cmd += ["--val-data", str(val_dir), "--val-every", str(every)]
    config_path = out / "runs" / f"{name}.yaml"
    nested: dict = {}
    for key, value in config.items():
        set_dotted(nested, key, value)
    config_path.write_text(yaml.safe_dump(nested))
    cmd += ["--config", str(config_path)]
    log = out / "runs" / f"{name}.log"
    with open(log, "w") as f:
        process = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ.copy())
    return DrafterRun(name, run_dir, process, log)


def finish_drafter(run: DrafterRun) -> dict:
    """Wait; a failed run is an error that shows the end of its log."""
    code = run.process.wait()
    if code != 0:
        tail = "\n".join(run.log.read_text().splitlines()[-30:])
        raise RuntimeError(f"drafter run {run.name!r} failed (exit {code}); {run.log}:\n{tail}")
    from flashdraft.model.checkpoint import latest_checkpoint

    lines = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    tail = lines[-4:]
    result = {
        "checkpoint": str(latest_checkpoint(run.run_dir / "checkpoints")),
        "steps": last["step"],
        "first_loss": lines[0]["loss"],
        "final_loss": last["loss"],
        "acc_slot1": last["acc_slot1"],
        # acceptance on training batches: the last 4 logged steps
        "tau_train": sum(m["tau_train"] for m in tail) / len(tail),
        # the median logged interval: the last one also holds the final tau probe
        "ctx_tok_s": statistics.median(m["ctx_tok_s"] for m in lines),
    }
    if taus := [[m["step"], m["tau"]] for m in lines if "tau" in m]:
        result["tau_during_training"] = taus
    if vals := [m for m in lines if "val_loss" in m]:
        # the same metrics on held-out conversations, and the served tau read off them
        keys = ("val_loss", "val_acc_slot1", "val_tau_train", "val_tau_walk")
        result["val_during_training"] = [[m["step"], *(m[k] for k in keys)] for m in vals]
        result |= {k: vals[-1][k] for k in (*keys, "val_acc_per_slot", "val_docs")}
    return result


def train_drafters(
    names: list[str], steps: int, summary: dict, out: Path, scale: Scale, prompts_path: Path
) -> dict:
    """`flashdraft train` for each variant, all at once (they share the GPU); the first failure stops all."""
    target_dir, data = Path(summary["target_dir"]), Path(summary["data_dir"])
    for n in names:  # a run killed before it finished: train again
        shutil.rmtree(out / "runs" / n, ignore_errors=True)
    val = Path(summary["val_dir"]) if "val_dir" in summary else None
    runs = [
        start_drafter(
            n, target_dir, data, out, scale, steps, VARIANTS[n], prompts_path if n == "main" else None, val
        )
        for n in names
    ]
    try:
        while any(r.process.poll() is None for r in runs):
            failed = [r for r in runs if r.process.poll() not in (None, 0)]
            if failed:
                finish_drafter(failed[0])
            time.sleep(0.5)
        return {r.name: finish_drafter(r) for r in runs}
    finally:  # one failed: stop the others rather than leave them training
        for r in runs:
            if r.process.poll() is None:
                r.process.kill()


def key_value(option: str, item: str, example: str) -> tuple[str, object]:
    """KEY=VALUE -> (KEY, VALUE read as YAML)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{option} {item!r}: expected KEY=VALUE, e.g. {example}")
    return key.strip(), yaml.safe_load(value)


def with_drafter_overrides(scale: Scale, items: list[str], step_ms: float | None = None) -> Scale:
    """The scale with its drafter config changed by KEY=VALUE items (dotted `flashdraft train` keys,
    values read as YAML), checked against the training config before anything runs; step_ms: the
    step time the budget plans with, which a change of shape changes."""
    from flashdraft.config import resolve_config

    drafter = dict(scale.drafter)
    for item in items:
        key, value = key_value("--drafter", item, "drafter.num_layers=5")
        drafter[key] = value
    resolve_config(scale.preset, **drafter)  # an unknown key or a bad value fails here, named
    scale = dataclasses.replace(scale, drafter=drafter)
    return scale if step_ms is None else dataclasses.replace(scale, drafter_step_s=step_ms / 1e3)


def with_scale_overrides(scale: Scale, items: list[str]) -> Scale:
    """The scale with plain fields (numbers, strings, flags) changed by KEY=VALUE items, e.g.
    conversations=131072; an unknown field or a value of another type fails, named."""
    fields = {f.name: getattr(scale, f.name) for f in dataclasses.fields(scale)}
    changes = {}
    for item in items:
        key, new = key_value("--scale", item, "conversations=131072")
        if key not in fields or isinstance(fields[key], dict):
            plain = sorted(k for k, v in fields.items() if not isinstance(v, dict))
            raise ValueError(f"--scale {item!r}: expected KEY=VALUE with KEY one of {', '.join(plain)}")
        old = fields[key]
        if isinstance(old, float) and type(new) is int:
            new = float(new)
        if old is not None and type(new) is not type(old):
            raise ValueError(f"--scale {key}: {new!r} is not a {type(old).__name__} like {old!r}")
        changes[key] = new
    return dataclasses.replace(scale, **changes)


def drafter_steps(remaining_s: float, scale: Scale, ablations: bool = False) -> int:
    """Steps that fit what is left of the budget once the drafter's start-up and the evals that
    follow it are set aside, at the measured step time (at least 50). With ablations, trained at the
    same time as the main drafter, their evals and their share of each step come out of it too."""
    training_s = remaining_s - scale.proof_eval_s - scale.drafter_startup_s
    step_s = scale.drafter_step_s
    if ablations:
        training_s -= scale.ablation_eval_s
        step_s += scale.ablation_step_s
    return max(50, int(training_s / step_s))


def run_proof(
    out: Path,
    budget_minutes: float,
    scale: Scale,
    ablations: bool = False,
    reference: bool = True,
    resume: bool = False,
    stop_after_prepare: bool = False,
) -> dict:
    """Every stage in order; OUT/proof.json is rewritten after each. The main flow (target, data, main
    drafter, evals, reference package) and the ablations, when asked for, fit the time budget; they
    train at the same time as the main drafter, for as many steps (asked for only in a resumed run,
    they train after it, on top of the budget). resume=True keeps the stages an earlier (killed)
    run of the same OUT finished and does the rest. stop_after_prepare: end once OUT/target, OUT/data
    and OUT/eval/prompts.jsonl are written, for a drafter trained by `flashdraft train` (run.sh)."""
    from flashdraft.eval.report import compare_methods, write_report
    from flashdraft.eval.spec import encode_prompt, eval_tau, mean_tau, read_prompts
    from flashdraft.model.checkpoint import load_drafter
    from flashdraft.model.target import load_target

    console = Console(width=None if sys.stdout.isatty() else 120)
    out = Path(out)
    record = out / "proof.json"
    if record.exists() and not resume:
        raise FileExistsError(f"{record} exists: pass --resume to finish that proof, or another --out")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    budget = 60 * budget_minutes
    summary = json.loads(record.read_text()) if record.exists() else {}
    clock = StageClock()
    laps = dict(summary.get("seconds", {}))

    def save(**more) -> None:  # after every stage, so a run cut short keeps what it measured
        summary.update(more)
        summary["wall_s"] = round(summary.get("wall_s", 0) + clock.since_start(), 1)
        clock.restart()
        summary["seconds"] = laps | clock.laps
        record.write_text(json.dumps(summary, indent=2) + "\n")

    prompts_path = out / "eval" / "prompts.jsonl"
    if "target_dir" not in summary:
        prep = prepare(out, budget, scale, console)
        prompts_path.parent.mkdir(parents=True, exist_ok=True)
        prompts_path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in prep.eval_prompts))
        laps |= prep.summary.pop("seconds")
        save(
            budget_s=budget,
            device=torch.cuda.get_device_name() if scale.device == "cuda" else "cpu",
            torch=torch.__version__,
            target_dir=str(prep.target_dir),
            data_dir=str(prep.data_dir),
            **prep.summary,
        )
    if stop_after_prepare:
        console.print(
            f"prepared: target {summary['target_dir']}, data {summary['data_dir']}, prompts {prompts_path}"
        )
        return summary
    target_dir = Path(summary["target_dir"])
    prompts = read_prompts(prompts_path)

    ablation_names = [n for n in VARIANTS if n != "main"] if ablations else []
    if "main" not in summary.get("drafters", {}):
        # wall_s: what earlier stages took, in this run or in a killed one this run resumes
        remaining = budget - summary["wall_s"] - clock.since_start()
        steps = drafter_steps(remaining, scale, ablations)
        console.print(
            f"main drafter: {steps} steps ({remaining:.0f} s of the budget left, "
            f"{scale.proof_eval_s:.0f} s of it kept for the evals"
            + (f"; the ablations {ablation_names} trained at the same time)" if ablations else ")")
        )
        names = ["main", *ablation_names]
        drafters = train_drafters(names, steps, summary, out, scale, prompts_path)
        clock.lap("drafters_s")
        save(drafter=dict(scale.drafter), drafter_steps=steps, drafters=drafters)
    main = summary["drafters"]["main"]

    def evaluate(temperature: float) -> None:
        t = f"T{temperature:g}"
        if f"tau_{t}" in summary:
            return
        report = compare_methods(
            target_dir,
            main["checkpoint"],
            prompts,
            max_new_tokens=scale.response_tokens,
            temperature=temperature,
            device=scale.device,
            cuda_graphs=scale.cuda_graphs,
        )
        write_report(report, out / "eval" / f"report_{t}.json")
        clock.lap(f"eval_{t}_s")
        save(
            **{
                f"tau_{t}": report["dflash"]["tau"],
                f"tau_ngram_{t}": report["ngram"]["tau"],
                f"tau_stderr_{t}": report["dflash"]["tau_stderr"],
                f"tau_ngram_stderr_{t}": report["ngram"]["tau_stderr"],
                f"tau_ratio_{t}": report["tau_ratio_dflash_over_ngram"],
                f"speedup_{t}": report["speedup"],
                f"acceptance_by_position_{t}": report["dflash"]["acceptance_by_position"],
            }
            | (
                {"identical_to_autoregressive_T0": report.get("identical_to_autoregressive")}
                if t == "T0"
                else {}
            )
        )

    evaluate(0.0)
    model, tokenizer = load_target(target_dir, scale.device)
    prompt_ids = [encode_prompt(tokenizer, m) for m in prompts]
    # the probe prompts: tau during training and the reference package, set against our eval on them
    ours = json.loads((out / "eval" / "report_T0.json").read_text())["dflash"]["tau_per_sample"]
    probe = min(scale.probe_prompts, len(prompts))
    if "tau_T0_probe_prompts" not in summary:
        save(probe_prompts=probe, tau_T0_probe_prompts=mean_tau(ours[:probe]))
    if reference and "reference" not in summary:
        ref = reference_beside_ours(
            Path(main["checkpoint"]),
            target_dir,
            prompt_ids[:probe],
            ours[:probe],
            scale.response_tokens,
            scale.device,
            out / "export" / "zlab",
        )
        clock.lap("reference_s")
        save(reference=ref)
    evaluate(1.0)
    if "main_flow_s" not in summary:  # the figure the time budget is about
        save(main_flow_s=round(summary["wall_s"] + clock.since_start(), 1))

    todo = [n for n in ablation_names if n not in summary["drafters"]]
    if todo:  # a resumed run that asks for ablations the first run did not
        steps = summary["drafter_steps"]
        console.print(f"ablations {todo}: {steps} steps each, as the main drafter, trained together")
        trained = train_drafters(todo, steps, summary, out, scale, prompts_path)
        clock.lap("ablation_drafters_s")
        save(drafters=summary["drafters"] | trained)
    for name in ablation_names:
        d = summary["drafters"][name]
        if "tau" not in d:
            drafter = load_drafter(d["checkpoint"], scale.device, dtype=model.dtype).eval()
            d["tau"] = eval_tau(
                model, tokenizer, drafter, prompt_ids, scale.response_tokens, cuda_graphs=scale.cuda_graphs
            )
            clock.lap(f"eval_{name}_s")
            save()
    print_proof(summary, console)
    return summary


def print_proof(s: dict, console: Console) -> None:
    table = Table(
        title=f"proof: {s['target_params'] / 1e6:.1f}M target (loss {s['target_loss']:.2f}), {s['device']}"
    )
    for col in (
        *("drafter", "steps", "loss", "tau_train", "val tau_train", "val walk"),
        *("tau T=0", "tau T=1", "speedup T=0"),
    ):
        table.add_column(col, justify="left" if col == "drafter" else "right")
    for name, d in s["drafters"].items():
        main = name == "main"
        table.add_row(
            name,
            str(d["steps"]),
            f"{d['final_loss']:.3f}",
            f"{d['tau_train']:.2f}",
            f"{d['val_tau_train']:.2f}" if "val_tau_train" in d else "-",
            f"{d['val_tau_walk']:.2f}" if "val_tau_walk" in d else "-",
            f"{(s['tau_T0'] if main else d['tau']):.2f}",
            f"{s['tau_T1']:.2f}" if main else "-",
            f"{s['speedup_T0']['dflash']:.2f}x" if main else "-",
        )
    table.add_row(
        "n-gram",
        "-",
        "-",
        "-",
        "-",
        "-",
        f"{s['tau_ngram_T0']:.2f}",
        f"{s['tau_ngram_T1']:.2f}",
        f"{s['speedup_T0']['ngram']:.2f}x",
    )
    if s.get("reference"):
        ref = f"{s['reference']['tau']:.2f}"
        table.add_row("main via dflash 0.1.0", "-", "-", "-", "-", "-", ref, "-", "-")
    console.print(table)
    for t in ("T0", "T1"):
        r = s.get(f"tau_ratio_{t}")
        if r and r["ratio"] is not None:
            lo, hi = r["ci95"]
            console.print(
                f"tau DFlash / n-gram at {t}: {r['ratio']:.2f} (95% interval {lo:.2f}-{hi:.2f} over "
                f"{r['samples']} prompts; tau standard error {s[f'tau_stderr_{t}']:.2f})"
            )
    probes = s["drafters"]["main"].get("tau_during_training")
    if probes and "tau_T0_probe_prompts" in s:
        console.print(
            f"tau during training at step {probes[-1][0]}: {probes[-1][1]:.2f}; the T = 0 eval's on the "
            f"same {s['probe_prompts']} prompts: {s['tau_T0_probe_prompts']:.2f}"
        )
    held = s["drafters"]["main"]
    if held.get("val_during_training"):
        (s0, _, _, v0, w0), (s1, loss, _, v1, w1) = (
            held["val_during_training"][0],
            held["val_during_training"][-1],
        )
        console.print(
            f"held-out conversations ({held['val_docs']} measured): tau_train {v0:.2f} at step {s0}, "
            f"{v1:.2f} at {s1} (loss {loss:.3f}; training batches {held['tau_train']:.2f}); walked as "
            f"decoding walks them {w0:.2f} -> {w1:.2f}"
        )
    console.print(f"stage seconds: {s['seconds']}; total {s['wall_s']:.0f} s")
