"""Drafter variants compared by served tau at equal training tokens (`flashdraft compare`).

Each variant is a set of `flashdraft train` overrides on a shared base. Every variant trains the same
steps with the same data and seed, so all see the same micro-batches. Then each decodes the same
prompts at every temperature, and its tau is compared with the first variant's by a paired bootstrap
(`flashdraft.eval.report.tau_ratio`). With `plain`, the target also decodes alone, and each row has the
variant's wall-clock speedup over it on the same prompts (each decoder timed in its own process, one
after another, after a warm-up).

A comparison directory OUT holds:
- spec.json: what is compared (`Comparison`); running the command again continues it, unchanged;
- NAME/run: each variant's training run; NAME/train.json once it has trained all its steps;
- NAME/SET_tT.json: its decoding of each prompt set at each temperature (per-sample tau, acceptance
  by draft position); ngram/SET_tT.json: prompt lookup on the same prompts, for scale;
  plain/SET_tT.json: the target decoding alone, for the speedups;
- table.json: the comparison (`comparison_table`).

The variants train side by side, one process each. On one H200, four SmolLM2 drafters trained at
54-62K context tokens/s each, together about what one alone reaches (219K). They then decode one after
another. `minutes` bounds one invocation: each variant stops with a checkpoint before it, and the same
command run again resumes each variant from its checkpoint.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

SAVE_MARGIN_S = 15.0  # a slice stops this long before the deadline: its checkpoint is written in time
FIRST_SLICE = 50  # steps of a worker's first slice, which also compiles; later slices fill the time left
NGRAM = "ngram"
PLAIN = "plain"
DECODERS = {NGRAM: "ngram", PLAIN: "autoregressive"}  # decoders beside the variants, and their methods


@dataclass(frozen=True)
class Comparison:
    target: str
    data: str
    base: dict  # `flashdraft train` overrides every variant starts from (dotted keys)
    variants: dict  # name -> overrides of the base; the first is the reference
    steps: int  # optimizer steps of every variant
    prompts: dict  # set name -> list of message lists
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 192
    preset: str = "default"
    device: str | None = None
    cuda_graphs: bool = False
    seed: int = 0
    ngram: bool = True  # also decode with prompt lookup, for scale
    plain: bool = False  # also decode with the target alone, for the variants' speedups
    extra: dict = field(default_factory=dict)  # what the caller records beside (e.g. its source run)

    def config(self, name: str):
        from flashdraft.config import resolve_config

        settings = {**self.base, **self.variants[name], "max_steps": self.steps, "seed": self.seed}
        return resolve_config(self.preset, **settings)

    @property
    def decoders(self) -> tuple[str, ...]:
        return (*self.variants, *([NGRAM] if self.ngram else []), *([PLAIN] if self.plain else []))

    def check(self) -> None:
        """Every variant's config resolves; names are usable as folder names."""
        if not self.variants:
            raise ValueError("no variants to compare")
        for name in self.variants:
            if name in DECODERS or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(
                    f"variant name {name!r}: letters, digits, '-' and '_' (and not {' or '.join(DECODERS)})"
                )
            try:
                self.config(name)
            except ValueError as e:
                raise ValueError(f"variant {name!r}: {e}") from None


def parse_settings(text: str, error: str) -> dict:
    """KEY=VALUE,KEY=VALUE: dotted `flashdraft train` keys, values read as YAML, so a list's commas stay
    in it (`drafter.layer_types=[sliding_attention,full_attention]`). ValueError(error) if malformed."""
    settings = {}
    for item in filter(None, re.split(r",(?=\s*[\w.]+=)", text)):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(error)
        settings[key.strip()] = yaml.safe_load(value)
    return settings


def parse_variant(text: str) -> tuple[str, dict]:
    """NAME or NAME:KEY=VALUE,KEY=VALUE, e.g. `gamma:position_weights=gamma`."""
    name, _, rest = text.partition(":")
    usage = f"--variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE], e.g. gamma:position_weights=gamma"
    return name.strip(), parse_settings(rest, usage)


def open_comparison(out: Path, given: Comparison | None) -> Comparison:
    """The comparison in `out` (spec.json), or `given` written there; a different `given` is refused."""
    path = out / "spec.json"
    if path.is_file():
        raw = json.loads(path.read_text())
        saved = Comparison(**{**raw, "temperatures": tuple(raw["temperatures"])})
        if given is not None and given != saved:
            raise ValueError(
                f"{out} holds another comparison ({path}): continue it without its settings, or use "
                "another --out"
            )
        return saved
    if given is None:
        raise ValueError(f"{path} does not exist: name what to compare")
    given.check()
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".spec.json.tmp")
    tmp.write_text(json.dumps(asdict(given), indent=1))
    tmp.replace(path)
    return given


def report_path(out: Path, who: str, set_name: str, temperature: float) -> Path:
    return out / who / f"{set_name}_t{temperature:g}.json"


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def trained(out: Path, name: str) -> bool:
    return (out / name / "train.json").is_file()


def decoded(cmp: Comparison, out: Path, who: str) -> bool:
    return all(report_path(out, who, s, t).is_file() for s in cmp.prompts for t in cmp.temperatures)


# ---- workers (one process each) -----------------------------------------------------------------


def train_variant(cmp: Comparison, out: Path, name: str, deadline: float) -> None:
    """Train `name` in slices until all its steps are done or the deadline nears (resuming its run)."""
    from flashdraft.model.checkpoint import latest_checkpoint
    from flashdraft.train.build import build_trainer

    run_dir = out / name / "run"
    resume = latest_checkpoint(run_dir / "checkpoints") is not None
    trainer = build_trainer(
        cmp.config(name), cmp.target, cmp.data, str(run_dir), cmp.device, resume=resume, overwrite=not resume
    )
    step_s = None
    while trainer.step < cmp.steps:
        left = deadline - time.time() - SAVE_MARGIN_S  # inf: no deadline
        steps = int(min(cmp.steps - trainer.step, FIRST_SLICE if step_s is None else left / step_s))
        if left <= 0 or steps < 1:
            break
        t0 = time.time()
        trainer.run(until=trainer.step + steps)
        step_s = (time.time() - t0) / steps
    if trainer.step >= cmp.steps:
        micro = trainer.spec.micro_per_step * cmp.steps
        tokens = sum(trainer.stream[m].num_tokens for m in range(micro))
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])
        kept = ("loss", "tau_train", "acc_1")
        summary = {"steps": trainer.step, "tokens": tokens} | {k: last[k] for k in kept if k in last}
        _write_json(out / name / "train.json", summary)
    trainer.close()


def decode_variant(cmp: Comparison, out: Path, who: str) -> None:
    """`who`'s decoding (a variant's DFlash, NGRAM: prompt lookup, PLAIN: the target alone) of every prompt
    set at every temperature, one report a set and temperature (a report already written is kept)."""
    from flashdraft.eval.report import method_summary
    from flashdraft.eval.spec import decoding_target, encode_prompt, run_methods
    from flashdraft.model.checkpoint import latest_checkpoint, load_drafter
    from flashdraft.model.target import default_device, load_target, stop_token_ids

    device = default_device(cmp.device)
    model, tokenizer = load_target(cmp.target, device)
    # prompt lookup and plain decoding need no drafter; the reference variant's gives the loop its taps
    name = next(iter(cmp.variants)) if who in DECODERS else who
    checkpoint = latest_checkpoint(out / name / "run" / "checkpoints")
    drafter = load_drafter(checkpoint, device, dtype=model.dtype).eval()
    target = decoding_target(model, drafter)
    stops = stop_token_ids(model, tokenizer)
    method = DECODERS.get(who, "dflash")
    for set_name, conversations in cmp.prompts.items():
        ids = [encode_prompt(tokenizer, c) for c in conversations]
        for temperature in cmp.temperatures:
            path = report_path(out, who, set_name, temperature)
            if path.is_file():
                continue
            t0 = time.time()
            results = run_methods(
                target, drafter, ids, cmp.max_new_tokens, drafter.block_size, temperature, stops, cmp.seed,
                cuda_graphs=cmp.cuda_graphs, methods=(method,),
            )  # fmt: skip
            summary = method_summary(results[method], drafter.block_size)
            outputs = [g.tokens for g in results[method]]  # equal across variants at T = 0: lossless
            _write_json(
                path,
                {"checkpoint": str(checkpoint), "method": method, "seconds": round(time.time() - t0, 1)}
                | summary
                | {"outputs": outputs},
            )


# ---- the comparison ------------------------------------------------------------------------------


def _spawn(out: Path, role: str, who: str, deadline: float) -> subprocess.Popen:
    log = out / who / f"{role}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flashdraft.compare", str(out), role, who, str(deadline)]
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def _wait(procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, int | None]:
    """Wait for every process; those still running at the deadline are killed (None: killed)."""
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(1.0)
    codes = {}
    for who, p in procs.items():
        if p.poll() is None:
            p.kill()
            p.wait()
            codes[who] = None
        else:
            codes[who] = p.returncode
    return codes


def run_comparison(cmp: Comparison, out: Path, minutes: float | None = None, say=print) -> dict | None:
    """Continue the comparison in `out` for at most `minutes` (None: no bound): the variants not yet
    trained train side by side (each to its last step, or as far as the time allows); once all are
    trained, each decoder in turn decodes, one process at a time. The table once everything is there
    (else None: run it again).

    Decoding one at a time: on one H200, four SmolLM2 drafters decoding at once in four processes (64
    prompts, 192 tokens, CUDA graphs) took 44 s a report, where one process alone takes 30-60 s; and a
    decoder that waits on others cannot be timed."""
    deadline = math.inf if minutes is None else time.time() + 60 * minutes
    todo = [n for n in cmp.variants if not trained(out, n)]
    if todo:
        until = "" if minutes is None else f" (until {time.ctime(deadline)})"
        say(f"training {', '.join(todo)} side by side to step {cmp.steps}{until}")
        _check(_wait({n: _spawn(out, "train", n, deadline) for n in todo}, deadline), out, "train")
    if any(not trained(out, n) for n in cmp.variants):
        say("out of time: the same command continues the training")
        return None
    for who in cmp.decoders:
        if not decoded(cmp, out, who) and time.time() < deadline:
            say(f"decoding with {who}")
            _check(_wait({who: _spawn(out, "decode", who, deadline)}, deadline), out, "decode")
    if any(not decoded(cmp, out, w) for w in cmp.decoders):
        say("out of time: the same command continues the decoding")
        return None
    table = comparison_table(cmp, out)
    _write_json(out / "table.json", table)
    return table


def _check(codes: dict[str, int | None], out: Path, role: str) -> None:
    failed = {w: c for w, c in codes.items() if c not in (0, None)}
    if failed:
        logs = ", ".join(str(out / w / f"{role}.log") for w in failed)
        raise RuntimeError(
            f"{role} failed for {', '.join(failed)} (exit {list(failed.values())}): see {logs}"
        )


def comparison_table(cmp: Comparison, out: Path) -> dict:
    """Per prompt set and temperature, each variant's tau (± standard error), its ratio to the first
    variant's with a 95% paired-bootstrap interval, acceptance at draft positions 1-3, and prompt
    lookup's tau, and with plain decoding the variant's speedup over it (time per output token); per
    variant, its training steps, tokens and last logged loss."""
    from flashdraft.eval.report import tau_ratio

    reference = next(iter(cmp.variants))
    rows = []
    for set_name in cmp.prompts:
        for t in cmp.temperatures:
            reports = {w: json.loads(report_path(out, w, set_name, t).read_text()) for w in cmp.decoders}
            base, ngram, plain = reports[reference], reports.get(NGRAM, {}), reports.get(PLAIN)
            for name in cmp.variants:
                r = reports[name]
                rows.append({
                    "set": set_name, "temperature": t, "variant": name, "tau": r["tau"],
                    "tau_stderr": r["tau_stderr"],
                    "vs_reference": tau_ratio(r["tau_per_sample"], base["tau_per_sample"]),
                    "acceptance_1_3": r["acceptance_by_position"][:3], "ngram_tau": ngram.get("tau"),
                    "speedup": _speedup(plain, r),
                })  # fmt: skip
    training = {n: json.loads((out / n / "train.json").read_text()) for n in cmp.variants}
    settings = {n: {**cmp.base, **v} for n, v in cmp.variants.items()}
    return {
        "reference": reference,
        "steps": cmp.steps,
        "rows": rows,
        "training": training,
        "settings": settings,
    }


def _speedup(plain: dict | None, report: dict) -> float | None:
    """Plain decoding's time per output token over the report's (None without plain decoding)."""
    if plain is None or not report.get("time_per_output_token_s"):
        return None
    return round(plain["time_per_output_token_s"] / report["time_per_output_token_s"], 3)


def print_comparison(table: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(
        title=f"served tau at {table['steps']} steps each; ratio to {table['reference']!r} (95% interval)"
    )
    speedups = any(r.get("speedup") is not None for r in table["rows"])
    columns = ("prompts", "T", "variant", "tau", "vs reference", "P(accept) 1-3", "n-gram")
    for col in columns + (("speedup",) if speedups else ()):
        t.add_column(col, justify="left" if col in ("prompts", "variant") else "right")
    for r in table["rows"]:
        v = r["vs_reference"]
        ratio = f"{v['ratio']:.3f} ({v['ci95'][0]:.2f}-{v['ci95'][1]:.2f})" if v["ratio"] else "-"
        accept = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_1_3"])
        se = r["tau_stderr"]  # None with one prompt
        tau = f"{r['tau']:.2f}" + ("" if se is None else f" ± {se:.2f}")
        t.add_row(
            r["set"],
            f"{r['temperature']:g}",
            r["variant"],
            tau,
            ratio,
            accept,
            "-" if r["ngram_tau"] is None else f"{r['ngram_tau']:.2f}",
            *([f"{r['speedup']:.2f}x" if r.get("speedup") else "-"] if speedups else []),
        )
    console.print(t)
    for name, tr in table["training"].items():
        console.print(
            f"{name}: {tr['steps']} steps, {tr['tokens']:,} tokens, loss {tr.get('loss', float('nan')):.3f}"
        )


def _worker(argv: list[str]) -> None:
    out, role, who, deadline = Path(argv[0]), argv[1], argv[2], float(argv[3])
    cmp = open_comparison(out, None)
    if role == "train":
        train_variant(cmp, out, who, deadline)
    elif role == "decode":
        decode_variant(cmp, out, who)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    _worker(sys.argv[1:])
