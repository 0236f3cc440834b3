"""Throughput of the proof's two target stages at several settings, to size the scratch-target proof.

1. Target pretraining (flashdraft.demo.pipeline.pretrain_target) at several batch sizes, eager or
   compiled: steps/s and tokens/s after the first 20% of each run (warm-up, compilation), and the loss
   reached in the same number of seconds.
2. Greedy regeneration (flashdraft.data.regenerate.LocalBackend, bf16, the last target trained) per
   cache and attention at several batch sizes: conversations/s, new tokens/s, generate's time per
   step next to one decoding forward's alone (what generate adds around the model), and how many
   outputs equal the first setting's.

The drafter's step time comes from `flashdraft bench --shape proof-95m`.

    python -m experiments.studies.proof_stages --out runs/stages [--seconds 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from experiments.scratch_target.flow import H200
from flashdraft.demo.pipeline import chat, code_windows, pretrain_target, source_files
from flashdraft.demo.tiny import build_tiny_target, build_tokenizer


class Recorder:
    """Stands in for rich's Progress: keeps (wall time, seconds done) of every update."""

    def __init__(self):
        self.points: list[tuple[float, float]] = []

    def update(self, task, completed: float, description: str) -> None:
        self.points.append((time.time(), completed))


@torch.inference_mode()
def decode_forward_ms(model, batch: int, context: int, sync, reps: int = 10) -> float:
    """One decoding step's forward alone (one new token per row after `context` cached ones), to set
    against generate's time per step: the difference is generate's own overhead."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=model.device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    one = ids[:, :1]
    times = []
    for _ in range(reps + 2):
        sync()
        t = time.perf_counter()
        model(input_ids=one, past_key_values=cache, use_cache=True)
        sync()
        times.append(time.perf_counter() - t)
        cache.crop(-1)
    return 1e3 * sorted(times[2:])[reps // 2]


def profile(backend, convs: list, path: Path, sync) -> None:
    """One regeneration under torch.profiler: the kernels and operators by GPU time, and how much of
    the wall time the GPU was busy (the rest is host work between kernels)."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t = time.time()
    with torch.profiler.profile(activities=activities) as prof:
        backend.regenerate(convs)
        sync()
    wall = time.time() - t
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
    head = f"wall {wall:.2f} s under the profiler; GPU kernels {kernels:.2f} s ({100 * kernels / wall:.0f}%)"
    order = "self_cuda_time_total" if activities[1:] else "self_cpu_time_total"
    table = events.table(sort_by=order, row_limit=30)
    path.write_text(head + "\n" + table + "\n")
    print(head, flush=True)
    print(table[:6000], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=20.0, help="training time per target setting")
    ap.add_argument("--batches", default="64,128,256", help="target batch sizes (eager)")
    ap.add_argument("--compiled", default="256", help="target batch sizes also run with compiled layers")
    ap.add_argument("--regen-batches", default="1024,4096")
    ap.add_argument("--regen-static", action="store_true", help="also on a static cache, compiled")
    ap.add_argument("--regen-caches", help="the caches to run, e.g. static (default: dynamic[,static])")
    ap.add_argument(
        "--regen-attention",
        default="grouped",
        help="LocalBackend attentions to run, e.g. grouped,sdpa,flex_attention",
    )
    ap.add_argument(
        "--profile", action="store_true", help="one more regeneration per setting under torch.profiler"
    )
    ap.add_argument("--source-mb", type=float, default=15.0, help="Python source to train on")
    ap.add_argument("--smoke", action="store_true", help="the proof's CPU shapes: check the script only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from experiments.scratch_target.flow import SMOKE

    scale = dataclasses.replace(SMOKE if args.smoke else H200, source_bytes=int(args.source_mb * 1e6))
    sync = torch.cuda.synchronize if scale.device == "cuda" else lambda: None
    texts = [f.read_text(errors="replace") for f in source_files(scale)]
    tokenizer = build_tokenizer(texts, vocab_size=scale.vocab_size)
    pairs = code_windows(texts, tokenizer, scale.prompt_tokens, scale.response_tokens)
    seq = scale.prompt_tokens + scale.response_tokens + 16
    rows = []
    runs = [(int(b), False) for b in args.batches.split(",") if b]
    runs += [(int(b), True) for b in args.compiled.split(",") if b]
    model = None
    for batch, compiled in runs:
        torch.manual_seed(0)
        model = build_tiny_target(tokenizer, **scale.target)
        s = dataclasses.replace(scale, target_batch=batch, target_compile=compiled)
        rec = Recorder()
        steps, loss = pretrain_target(model, tokenizer, pairs, args.seconds, rec, None, s)
        warm = [p for p in rec.points if p[1] >= 0.2 * args.seconds]
        if len(warm) < 2:
            print(f"batch {batch} compiled={compiled}: too few steps in {args.seconds} s to time", flush=True)
            continue
        (t0, _), (t1, _) = warm[0], warm[-1]
        rate = 10 * (len(warm) - 1) / (t1 - t0)  # one update every 10 steps
        rows.append(
            {"stage": "target", "batch": batch, "compiled": compiled, "steps": steps, "loss": loss,
             "steps_s": rate, "tok_s": rate * batch * seq}
        )  # fmt: skip
        print(rows[-1], flush=True)

    trained = build_tiny_target(tokenizer, **scale.target)  # uncompiled, as the proof reloads it
    trained.load_state_dict(model.state_dict())
    model = trained.to(scale.device, torch.bfloat16 if scale.device == "cuda" else torch.float32).eval()
    from flashdraft.data.regenerate import LocalBackend

    generate_s: list[float] = []
    untimed_generate = model.generate

    def timed_generate(*a, **k):  # generate's share of a regeneration; the rest is templates and decoding
        sync()
        t = time.time()
        out = untimed_generate(*a, **k)
        sync()
        generate_s.append(time.time() - t)
        return out

    model.generate = timed_generate
    kinds = ["dynamic", "static"] if args.regen_static else ["dynamic"]
    if args.regen_caches:
        kinds = args.regen_caches.split(",")
    settings = [(kind, attn) for kind in kinds for attn in args.regen_attention.split(",")]
    for batch in [int(b) for b in args.regen_batches.split(",")]:
        convs = [chat(p["prompt"], p["response"]) for p in pairs[:batch]]
        first_outputs = None
        for kind, attn in settings:
            model.set_attn_implementation("sdpa")  # what the backend's attention option starts from
            backend = LocalBackend(
                model,
                tokenizer,
                max_new_tokens=scale.response_tokens,
                batch_size=batch,
                cache=kind,
                attention=attn,
            )
            first = time.time()
            backend.regenerate(convs[:8] if kind == "dynamic" else convs)  # warm-up (and compilation)
            first = time.time() - first
            sync()
            generate_s.clear()
            t = time.time()
            done = backend.regenerate(convs)
            sync()
            seconds = time.time() - t
            outputs = [c[-1]["content"] for c in done]
            first_outputs = first_outputs or outputs
            same = sum(a == b for a, b in zip(outputs, first_outputs, strict=True))
            new = sum(len(tokenizer(c[-1]["content"])["input_ids"]) for c in done)
            peak = torch.cuda.max_memory_allocated() / 2**30 if scale.device == "cuda" else 0.0
            rows.append(
                {"stage": "regenerate", "cache": kind, "attention": attn, "batch": batch, "seconds": seconds,
                 "first_call_s": first, "conv_s": batch / seconds, "new_tok_s": new / seconds,
                 "peak_gib": peak, "step_ms": 1e3 * seconds / scale.response_tokens,
                 "generate_step_ms": 1e3 * sum(generate_s) / scale.response_tokens,
                 "forward_ms": decode_forward_ms(model, batch, scale.prompt_tokens + 16, sync),
                 "outputs_equal_to_first_setting": same}
            )  # fmt: skip
            print(rows[-1], flush=True)
            if args.profile:
                profile(backend, convs, args.out / f"profile_{kind}_{attn}_{batch}.txt", sync)
    (args.out / "stages.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
