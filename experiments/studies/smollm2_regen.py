"""Regeneration throughput of SmolLM2-135M-Instruct (the proof's `data regenerate` stage) per batch size.

The SmolLM2 proof spends most of its data time answering prompts (65,664 answers in 299 s at batch
4,096 on the H200, 220 a second), and its drafter reads each answer about ten times: answers a second
decide how much data a time budget can make. For each batch size this answers `--batches` + 1
batches of the proof's synthesized prompts with flashdraft.data.regenerate.LocalBackend (static cache,
CUDA graphs, the proof's 256 new tokens) at `--temperature`; the first batch of a size compiles and is
not counted. Prints and writes conversations a second, new tokens a second (the answers' tokens) and the
peak GPU memory; medians over the counted batches.

    python -m experiments.studies.smollm2_regen --prompts PROOF_DIR --out OUT \\
        [--sizes 4096,8192 --batches 1 --profile]

PROOF_DIR holds prompts.chat.jsonl and prompts.code.jsonl (a proof directory, or the unpacked
proofdata.tgz of dev/smollm2_gpu.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from experiments.studies.proof_stages import profile
from flashdraft.data.regenerate import LocalBackend
from flashdraft.demo.real_target import gguf_to_hf, smollm2_gguf
from flashdraft.model.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="4096,8192", help="batch sizes, comma-separated")
    ap.add_argument("--batches", type=int, default=1, help="timed batches per size, after one warm-up")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per answer at most")
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script only")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="then the first batch once more under torch.profiler (OUT/profile_B.txt)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = []
    for kind in ("chat", "code"):
        path = args.prompts / f"prompts.{kind}.jsonl"
        prompts += [json.loads(line)["messages"] for line in path.read_text().split("\n") if line.strip()]
    model, tokenizer = load_target(gguf_to_hf(smollm2_gguf(), args.out / "target"), args.device)
    cuda = args.device.startswith("cuda")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        need = size * (args.batches + 1)
        if need > len(prompts):
            raise SystemExit(f"{args.prompts}: {len(prompts)} prompts, {need} needed at batch {size}")
        backend = LocalBackend(model, tokenizer, args.tokens, args.temperature, size, cache="static")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds, tokens = [], []
        for b in range(args.batches + 1):
            chunk = prompts[b * size : (b + 1) * size]
            t0 = time.perf_counter()
            answers = backend.regenerate(chunk)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            new = sum(len(tokenizer(a[-1]["content"], add_special_tokens=False).input_ids) for a in answers)
            warm = " (warm-up)" if b == 0 else ""
            print(f"batch {size} #{b}: {dt:.1f} s, {new} new tokens{warm}", flush=True)
            if b:
                seconds.append(dt)
                tokens.append(new / dt)
        s = statistics.median(seconds)
        rows.append(
            {
                "batch": size,
                "conversations_per_s": round(size / s, 1),
                "new_tokens_per_s": round(statistics.median(tokens)),
                "batch_s": round(s, 2),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
                "temperature": args.temperature,
                "max_new_tokens": args.tokens,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        if args.profile:
            sync = torch.cuda.synchronize if cuda else lambda: None
            profile(backend, prompts[:size], args.out / f"profile_{size}.txt", sync)
        del backend
    (args.out / "smollm2_regen.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("| batch | conversations/s | new tokens/s | s a batch | peak GiB |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['conversations_per_s']} | {r['new_tokens_per_s']} | {r['batch_s']} | "
            f"{r['peak_gib']} |"
        )


if __name__ == "__main__":
    main()
