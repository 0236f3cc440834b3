"""`flashdraft demo`: the whole pipeline on a CPU in minutes, with nothing downloaded.

1. a byte-level BPE tokenizer and a tiny Qwen3 target, trained here on the standard library's
   Python source as chat turns (user: the start of a code window, assistant: what follows);
2. training conversations whose assistant turns the target itself rewrites (greedy, local backend),
   their prompts from other source files than the target's (`Scale.prompt_tenths`);
3. `data prepare`'s tokenizer with the chat template and assistant-only loss masks -> token shards;
4. a DFlash drafter trained online against the target (`flashdraft train`'s Trainer);
5. speculative decoding on held-out prompts: DFlash vs n-gram lookup vs plain decoding.
"""

from __future__ import annotations

import json
import re
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from flashdraft.demo.tiny import build_tiny_target, build_tokenizer, save_target, stdlib_files


@dataclass(frozen=True)
class Scale:
    """Everything that differs between the CPU demo and a GPU run of the same pipeline
    (experiments/scratch_target/flow.py's H200)."""

    device: str = "cpu"
    vocab_size: int = 1024
    target: dict = field(default_factory=lambda: dict(hidden=128, layers=6, heads=4, kv_heads=2))
    target_batch: int = 16
    target_lr: float = 3e-3
    target_compile: bool = False  # torch.compile the target's decoder layers (regional) for its pretraining
    prompt_tokens: int = 48
    response_tokens: int = 64
    conversations: int = 960
    regen_batch: int = 64
    regen_cache: str = "dynamic"  # LocalBackend's cache: "static" compiles generate's decoding step
    prepare_procs: int = 1  # processes that tokenize in `data prepare`
    drafter: dict = field(default_factory=lambda: {"drafter.num_layers": 2, "drafter.num_taps": 2})
    preset: str = "tiny_cpu"
    drafter_step_s: float = 0.15  # to turn the time budget into a step count
    eval_prompts: int = 24
    probe_prompts: int = 24  # the proof: the first N eval prompts for tau during training and the reference
    target_share: float = 0.3  # of the time budget
    drafter_share: float = 0.5  # of the time left after the data step (the CPU demo)
    # the proof plans its drafter from measured costs instead: what follows the drafter's steps
    proof_eval_s: float = 60.0  # T = 0 and T = 1 evals and the reference package
    drafter_startup_s: float = 15.0  # process start, compilation, the tau probes
    # the proof's ablations, planned into its budget: one step of both trained at once, and their evals
    ablation_step_s: float = 0.3
    ablation_eval_s: float = 20.0
    cuda_graphs: bool = False  # the proof's evals on fixed-shape caches replayed as CUDA graphs
    source_bytes: int | None = None  # None: the standard library; else this much installed Python source
    # of every 10 source files: 1 is held out for the eval, this many give the drafter's training
    # prompts, the rest train the target. Served prompts are text the target never trained on, so the
    # drafter's should be too: on memorised text a target continues with the file, on unseen text
    # with its own habits (repeats), which are what the drafter must learn. 0: the target's windows.
    prompt_tenths: int = 0
    # the drafter's prompt windows start every this many tokens of their files (None: back to back);
    # overlapping windows give more prompts from the same files
    prompt_stride: int | None = None
    # of `conversations`, this many are windows of the eval's files (not its prompts) that the drafter
    # never trains on: loss, accuracy and tau_train measured on them during training (`val_data`)
    val_conversations: int = 0


CPU = Scale(prompt_tenths=3, val_conversations=64)


def source_files(scale: Scale) -> list[Path]:
    if scale.source_bytes is None:
        return stdlib_files()
    root = Path(sysconfig.get_paths()["purelib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        size = path.stat().st_size
        if size > 2000 and total < scale.source_bytes:
            files.append(path)
            total += size
    if total < scale.source_bytes:
        raise ValueError(
            f"source_bytes={scale.source_bytes:,} asked for, but {root} holds only {total:,} bytes of "
            "Python files over 2 KB"
        )
    return files


def split_files(files: list[Path], prompt_tenths: int) -> dict[str, list[Path]]:
    """Disjoint, interleaved (so each package feeds all three): eval prompts, drafter prompts, target."""
    if not 0 <= prompt_tenths <= 8:
        raise ValueError(f"prompt_tenths must be in 0..8 (1 of 10 files is the eval's), got {prompt_tenths}")
    split: dict[str, list[Path]] = {"eval": [], "prompts": [], "target": []}
    for i, f in enumerate(files):
        k = i % 10
        split["eval" if k == 0 else "prompts" if k <= prompt_tenths else "target"].append(f)
    return split


def code_windows(
    texts: list[str], tokenizer, prompt_tokens: int, response_tokens: int, stride: int | None = None
) -> list[dict]:
    """Windows of each text, one every `stride` tokens (default: back to back): {prompt, response, ids,
    text} split at `prompt_tokens`, `text` the index of the window's text."""
    span = prompt_tokens + response_tokens
    windows, origin = [], []
    for t, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):  # batched in Rust
        starts = range(0, len(ids) - span + 1, stride or span)
        windows += [ids[start : start + span] for start in starts]
        origin += [t] * len(starts)
    prompts = tokenizer.batch_decode([w[:prompt_tokens] for w in windows])
    responses = tokenizer.batch_decode([w[prompt_tokens:] for w in windows])
    pairs = zip(prompts, responses, windows, origin, strict=True)
    return [{"prompt": p, "response": r, "ids": w, "text": t} for p, r, w, t in pairs]


def chat(prompt: str, response: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": prompt}]
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    return messages


def _progress(console: Console) -> Progress:
    columns = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    return Progress(*columns, console=console)


def pretrain_target(model, tokenizer, pairs: list[dict], seconds: float, progress, task, scale: Scale = CPU):
    """Causal-LM training of the target on chat-rendered windows, for a time budget."""
    seq_len = scale.prompt_tokens + scale.response_tokens + 16
    # the chat template around the window's own ids (re-encoding 80K rendered windows costs a minute)
    rendered = tokenizer.apply_chat_template(chat("\ue000", "\ue001"), tokenize=False)
    head, mid, tail = (
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in re.split("[\ue000\ue001]", rendered)
    )
    cut = scale.prompt_tokens
    enc = [(head + p["ids"][:cut] + mid + p["ids"][cut:] + tail)[:seq_len] for p in pairs]
    ids = torch.full((len(enc), seq_len), tokenizer.pad_token_id)
    labels = torch.full((len(enc), seq_len), -100)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
        labels[i, : len(e)] = torch.tensor(e)
    device = torch.device(scale.device)
    model.to(device)
    ids, labels = ids.to(device), labels.to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=scale.target_lr, weight_decay=0.01, fused=device.type == "cuda"
    )
    if scale.target_compile:  # regional: one compiled graph serves every decoder layer
        for layer in model.get_decoder().layers:
            layer.compile()
    g = torch.Generator(device).manual_seed(0)
    model.train()
    start, step, loss = time.time(), 0, float("nan")
    while time.time() - start < seconds:
        frac = (time.time() - start) / seconds
        for group in opt.param_groups:
            group["lr"] = scale.target_lr * min(1.0, (step + 1) / 20) * max(0.05, 1 - frac)
        idx = torch.randint(0, len(enc), (scale.target_batch,), generator=g, device=device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=ids[idx], labels=labels[idx], use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 10 == 0:  # reading the loss waits for the GPU: not every step
            loss = out.loss.item()
            progress.update(
                task, completed=min(seconds, time.time() - start), description=f"target loss {loss:.3f}"
            )
    if step:
        loss = out.loss.item()  # the last step's, not the last one read
    model.eval().to("cpu")
    return step, loss


def run_demo(out: Path, budget_minutes: float = 8.0) -> dict:
    return run_pipeline(out, budget_minutes, CPU)


@dataclass
class Prepared:
    """What the drafter stage needs: the target, the token shards, held-out prompts, and what it took."""

    target_dir: Path
    data_dir: Path
    eval_prompts: list[list[dict]]
    summary: dict  # target size, steps and loss; conversations; seconds per stage


def prepare(out: Path, budget_s: float, scale: Scale, console: Console) -> Prepared:
    """Steps 1-3: tokenizer and target trained on real code, conversations the target rewrites, shards."""
    from flashdraft.data.prepare import PrepareOptions, prepare_dataset
    from flashdraft.data.regenerate import LocalBackend, regenerate_file
    from flashdraft.model.target import load_target

    clock = StageClock()
    split = split_files(source_files(scale), scale.prompt_tenths)
    train_texts = [f.read_text(errors="replace") for f in split["target"]]
    console.print(
        f"[bold]flashdraft[/] -> {out} (Python source files: {len(split['target'])} train the target, "
        f"{len(split['prompts']) or 'its'} give the drafter's prompts, {len(split['eval'])} the eval's)"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "sources.json").write_text(
        json.dumps({k: [str(f) for f in v] for k, v in split.items()}, indent=1)
    )
    tokenizer = build_tokenizer(train_texts, vocab_size=scale.vocab_size)
    pairs = code_windows(train_texts, tokenizer, scale.prompt_tokens, scale.response_tokens)
    target = build_tiny_target(tokenizer, **scale.target)
    clock.lap("tokenizer_s")

    with _progress(console) as progress:
        seconds = scale.target_share * budget_s
        task = progress.add_task("target", total=seconds)
        steps_target, target_loss = pretrain_target(target, tokenizer, pairs, seconds, progress, task, scale)
    target_dir = save_target(target, tokenizer, out / "target")
    n_params = sum(p.numel() for p in target.parameters())
    console.print(f"target: {n_params / 1e6:.1f}M params, {steps_target} steps, loss {target_loss:.3f}")
    clock.lap("target_s")

    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    prompt_files, pool = split["target"], pairs  # prompt_tenths=0: the target's own windows
    if split["prompts"]:
        prompt_files = split["prompts"]
        texts = [f.read_text(errors="replace") for f in prompt_files]
        pool = code_windows(
            texts, tokenizer, scale.prompt_tokens, scale.response_tokens, stride=scale.prompt_stride
        )
    n_train = scale.conversations - scale.val_conversations
    if len(pool) < n_train:
        raise ValueError(
            f"{n_train} conversations asked for, but the drafter's prompt files hold only "
            f"{len(pool)} windows: raise source_bytes, lower prompt_stride or lower conversations"
        )
    eval_files = split["eval"]
    held_texts = [f.read_text(errors="replace") for f in eval_files]
    held = code_windows(held_texts, tokenizer, scale.prompt_tokens, scale.response_tokens)
    eval_picks = range(0, len(held), max(1, len(held) // scale.eval_prompts))[: scale.eval_prompts]
    eval_pairs = [held[i] for i in eval_picks]
    val_pool = [i for i in range(len(held)) if i not in eval_picks]  # the same files, not the prompts
    if len(val_pool) < scale.val_conversations:
        raise ValueError(
            f"{scale.val_conversations} validation conversations asked for, but the eval's files hold "
            f"only {len(val_pool)} windows besides its prompts: lower val_conversations"
        )
    g = torch.Generator().manual_seed(1)
    picks = torch.randperm(len(pool), generator=g)[:n_train].tolist()
    val_picks = [val_pool[i] for i in torch.randperm(len(val_pool), generator=g)[: scale.val_conversations]]
    source = data_dir / "conversations.jsonl"
    with open(source, "w") as f:
        for i in picks:
            w = pool[i]
            record = {"id": f"{prompt_files[w['text']]}#{i}", "messages": chat(w["prompt"], w["response"])}
            f.write(json.dumps(record) + "\n")
        for i in val_picks:
            w = held[i]
            record = {"id": f"{VAL}{eval_files[w['text']]}#{i}", "messages": chat(w["prompt"], w["response"])}
            f.write(json.dumps(record) + "\n")
    clock.lap("prompts_s")  # the drafter's prompt files windowed, the conversations written
    regenerated = data_dir / "regenerated.jsonl"
    served, _ = load_target(target_dir, scale.device)  # the target as training and decoding load it (bf16)
    backend = LocalBackend(
        served,
        tokenizer,
        max_new_tokens=scale.response_tokens,
        temperature=0.0,
        batch_size=scale.regen_batch,
        cache=scale.regen_cache,
    )
    with console.status("the target rewrites the assistant turns (greedy): flashdraft data regenerate"):
        regenerate_file(backend, str(source), regenerated, progress=False)
    del served, backend
    clock.lap("regenerate_s")
    options = PrepareOptions(
        max_length=4 * (scale.prompt_tokens + scale.response_tokens),
        cache_dir=out / "cache",
        num_proc=scale.prepare_procs,
        overwrite=True,  # the demo's own directories, written again by each run
    )
    val_dir = None
    if scale.val_conversations:
        val_dir = out / "val"
        regenerated = split_off(regenerated, VAL, val_dir / "regenerated.jsonl")
        val = prepare_dataset(str(val_dir / "regenerated.jsonl"), tokenizer, val_dir, options)
        if val["kept"] == 0:
            raise ValueError(
                f"validation: the target answered none of its {scale.val_conversations} held-out prompts "
                f"(see {data_dir}/regenerated.jsonl.failed.jsonl); train the target longer or set "
                "val_conversations=0"
            )
    stats = prepare_dataset(str(regenerated), tokenizer, data_dir, options)
    console.print(f"data: {stats['kept']} conversations, {stats['loss_tokens']} loss tokens -> {data_dir}")
    if val_dir is not None:
        console.print(f"validation: {val['kept']} conversations of the eval's files -> {val_dir}")
    clock.lap("prepare_s")

    summary = {
        "target_params": n_params,
        "target_steps": steps_target,
        "target_loss": target_loss,
        "conversations": stats["kept"],
        "loss_tokens": stats["loss_tokens"],
        "seconds": clock.laps,
    } | ({"val_dir": str(val_dir), "val_conversations": val["kept"]} if val_dir else {})
    return Prepared(target_dir, data_dir, [chat(p["prompt"]) for p in eval_pairs], summary)


VAL = "val:"  # id prefix of the validation conversations, regenerated in the same batches as the rest


def split_off(path: Path, prefix: str, to: Path) -> Path:
    """Records of a JSONL file whose id starts with `prefix` go to `to`, the rest to PATH.rest.jsonl
    (returned); the file itself is left as the regeneration wrote it."""
    rest = path.with_suffix(".rest.jsonl")
    to.parent.mkdir(parents=True, exist_ok=True)
    with open(path) as f, open(rest, "w") as r, open(to, "w") as v:
        for line in f:
            (v if json.loads(line)["id"].startswith(prefix) else r).write(line)
    return rest


class StageClock:
    """Seconds per named stage (`lap`), and since the last `restart`."""

    def __init__(self):
        self.last = self.start = time.time()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.time()
        self.laps[name] = round(now - self.last, 1)
        self.last = now

    def since_start(self) -> float:
        return time.time() - self.start

    def restart(self) -> None:
        """A new accounting period: wall time and the next lap both count from now."""
        self.last = self.start = time.time()


def run_pipeline(out: Path, budget_minutes: float, scale: Scale) -> dict:
    from flashdraft.config import resolve_config
    from flashdraft.eval.report import compare_methods, print_table, write_report
    from flashdraft.train.build import build_trainer

    console = Console()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t_start = time.time()
    budget = 60 * budget_minutes
    prep = prepare(out, budget, scale, console)

    # a share of the time left trains the drafter (a step takes ~0.15 s on 2 cores); eval follows
    remaining = budget - (time.time() - t_start)
    steps = max(50, int(scale.drafter_share * remaining / scale.drafter_step_s))
    # validation (held-out conversations) once, at the last step
    val = prep.summary.get("val_dir")
    cfg = resolve_config(scale.preset, **scale.drafter, log_every=25, max_steps=steps, val_data=val)
    trainer = build_trainer(
        cfg, str(prep.target_dir), str(prep.data_dir), str(out / "run"), device=scale.device, overwrite=True
    )
    with _progress(console) as progress:
        task = progress.add_task("drafter", total=trainer.total_steps)
        result = trainer.run(
            progress=lambda s, n, loss: progress.update(
                task, completed=s, description=f"drafter loss {loss:.3f}"
            )
        )
    console.print(f"drafter: loss {result.first_loss:.3f} -> {result.final_loss:.3f} in {result.steps} steps")
    last = trainer.last_metrics
    if "val_tau_walk" in last:
        console.print(
            f"tau_train: {last['tau_train']:.2f} on a training batch, {last['val_tau_train']:.2f} on "
            f"{last['val_docs']} held-out conversations, {last['val_tau_walk']:.2f} walked as decoding walks"
        )

    with console.status("speculative decoding on held-out prompts"):
        report = compare_methods(
            prep.target_dir,
            result.checkpoint,
            prep.eval_prompts,
            max_new_tokens=scale.response_tokens,
            device=scale.device,
        )
    write_report(report, out / "eval" / "report.json")
    print_table(report, console)
    summary = {
        "wall_s": round(time.time() - t_start, 1),
        **{k: v for k, v in prep.summary.items() if k.startswith("target_")},
        "drafter_first_loss": result.first_loss,
        "drafter_final_loss": result.final_loss,
        "drafter_steps": result.steps,
        **{k: last[k] for k in ("tau_train", "val_tau_train", "val_tau_walk", "val_docs") if k in last},
        "tau": report["dflash"]["tau"],
        "tau_ngram": report["ngram"]["tau"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"demo finished in {summary['wall_s']:.0f} s; summary in {out / 'summary.json'}")
    return summary
