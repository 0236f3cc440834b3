"""`flashdraft demo`: the whole pipeline on a CPU in minutes, with nothing downloaded.

1. a byte-level BPE tokenizer and a tiny Qwen3 target, trained here on the standard library's
   Python source as chat turns (user: the start of a code window, assistant: what follows);
2. training conversations whose assistant turns the target itself rewrites (greedy, local backend);
3. `data prepare`'s tokenizer with the chat template and assistant-only loss masks -> token shards;
4. a DFlash drafter trained online against the target (`flashdraft train`'s Trainer);
5. speculative decoding on held-out prompts: DFlash vs n-gram lookup vs plain decoding.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from flashdraft.demo.tiny import build_tiny_target, build_tokenizer, save_target, stdlib_files

PROMPT_TOKENS = 48
RESPONSE_TOKENS = 64


def code_windows(texts: list[str], tokenizer, prompt_tokens: int, response_tokens: int) -> list[dict]:
    """Consecutive windows of each text: {prompt, response} split at `prompt_tokens`."""
    pairs = []
    span = prompt_tokens + response_tokens
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - span + 1, span):
            window = ids[start : start + span]
            pairs.append(
                {
                    "prompt": tokenizer.decode(window[:prompt_tokens]),
                    "response": tokenizer.decode(window[prompt_tokens:]),
                }
            )
    return pairs


def chat(prompt: str, response: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": prompt}]
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    return messages


def pretrain_target(model, tokenizer, pairs: list[dict], seconds: float, progress, task, seq_len: int = 128):
    """Causal-LM training of the tiny target on chat-rendered windows, for a time budget."""
    texts = [tokenizer.apply_chat_template(chat(p["prompt"], p["response"]), tokenize=False) for p in pairs]
    enc = [tokenizer(t, add_special_tokens=False)["input_ids"][:seq_len] for t in texts]
    ids = torch.full((len(enc), seq_len), tokenizer.pad_token_id)
    labels = torch.full((len(enc), seq_len), -100)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
        labels[i, : len(e)] = torch.tensor(e)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    model.train()
    start, step, loss = time.time(), 0, float("nan")
    while time.time() - start < seconds:
        frac = (time.time() - start) / seconds
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20) * max(0.05, 1 - frac)
        idx = torch.randint(0, len(enc), (16,), generator=g)
        out = model(input_ids=ids[idx], labels=labels[idx])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        step += 1
        loss = out.loss.item()
        progress.update(
            task, completed=min(seconds, time.time() - start), description=f"target loss {loss:.3f}"
        )
    model.eval()
    return step, loss


def run_demo(out: Path, budget_minutes: float = 8.0) -> dict:
    from flashdraft.config import resolve_config
    from flashdraft.data.prepare import PrepareOptions, prepare_dataset
    from flashdraft.data.regenerate import LocalBackend, regenerate_file
    from flashdraft.eval.report import compare_methods, print_table, write_report
    from flashdraft.train.trainer import build_trainer

    console = Console()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t_start = time.time()
    budget = 60 * budget_minutes
    files = stdlib_files()
    held_out = files[::10]
    train_files = [f for f in files if f not in set(held_out)]
    train_texts = [f.read_text(errors="replace") for f in train_files]

    console.print(f"[bold]flashdraft demo[/] -> {out} ({len(train_files)} stdlib files for training)")
    tokenizer = build_tokenizer(train_texts, vocab_size=1024)
    pairs = code_windows(train_texts, tokenizer, PROMPT_TOKENS, RESPONSE_TOKENS)
    target = build_tiny_target(tokenizer, hidden=128, layers=6, heads=4, kv_heads=2)

    columns = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("target", total=0.3 * budget)
        steps, target_loss = pretrain_target(target, tokenizer, pairs, 0.3 * budget, progress, task)
    target_dir = save_target(target, tokenizer, out / "target")
    console.print(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, {steps} steps, "
                  f"loss {target_loss:.3f} -> {target_dir}")  # fmt: skip

    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    picks = torch.randperm(len(pairs), generator=g)[:320].tolist()
    source = data_dir / "conversations.jsonl"
    with open(source, "w") as f:
        for i in picks:
            record = {"id": f"demo-{i}", "messages": chat(pairs[i]["prompt"], pairs[i]["response"])}
            f.write(json.dumps(record) + "\n")
    regenerated = data_dir / "regenerated.jsonl"
    backend = LocalBackend(target, tokenizer, max_new_tokens=RESPONSE_TOKENS, temperature=0.0, batch_size=32)
    with console.status("the target rewrites the assistant turns (greedy): flashdraft data regenerate"):
        regenerate_file(backend, str(source), regenerated, progress=False)
    options = PrepareOptions(max_length=256, cache_dir=out / "cache")
    stats = prepare_dataset(str(regenerated), tokenizer, data_dir, options)
    console.print(f"data: {stats['kept']} conversations, {stats['loss_tokens']} loss tokens -> {data_dir}")

    cfg = resolve_config("tiny_cpu", **{"drafter.num_layers": 2, "drafter.num_taps": 2, "log_every": 10})
    trainer = build_trainer(cfg, str(target_dir), str(data_dir), str(out / "run"), device="cpu")
    remaining = budget - (time.time() - t_start)
    trainer.total_steps = min(trainer.total_steps, max(20, int(0.45 * remaining / 0.5)))
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("drafter", total=trainer.total_steps)
        result = trainer.run(
            progress=lambda s, n, loss: progress.update(
                task, completed=s, description=f"drafter loss {loss:.3f}"
            )
        )
    console.print(f"drafter: loss {result.first_loss:.3f} -> {result.final_loss:.3f} in {result.steps} steps")

    held_texts = [f.read_text(errors="replace") for f in held_out]
    eval_pairs = code_windows(held_texts, tokenizer, PROMPT_TOKENS, RESPONSE_TOKENS)[:24]
    prompts = [chat(p["prompt"]) for p in eval_pairs]
    with console.status("speculative decoding on held-out prompts"):
        report = compare_methods(
            target_dir, result.checkpoint, prompts, max_new_tokens=RESPONSE_TOKENS, device="cpu"
        )
    write_report(report, out / "eval" / "report.json")
    print_table(report, console)
    summary = {
        "wall_s": round(time.time() - t_start, 1),
        "target_loss": target_loss,
        "drafter_first_loss": result.first_loss,
        "drafter_final_loss": result.final_loss,
        "drafter_steps": result.steps,
        "tau": report["dflash"]["tau"],
        "tau_ngram": report["ngram"]["tau"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"demo finished in {summary['wall_s']:.0f} s; summary in {out / 'summary.json'}")
    return summary
