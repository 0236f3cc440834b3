"""When does a drafter pay off in llama.cpp? Tau and tokens/s over drafter precision, draft length and
threads, with the cost of one step split into the target's verify and the drafter's draft.

For each thread count the target alone is served once: its tokens/s, and the time of one target forward
over w new tokens on a cached prefix (w = 1, 2, 4, 8, 16: what a verify of w - 1 drafts costs). Then
target + drafter for each drafter type (`flashdraft export --gguf-type`) and draft length. A step
commits tau tokens in tau / (tokens/s) seconds; of that, the verify of n + 1 tokens is measured, and the
rest is the drafter (its forward over the block, the context features it reads, the sampling). The
model: speedup = tau x t(1) / (t_verify(n + 1) + t_draft(n + 1)).

    python benchmarks/engine_payoff.py --target target.gguf --checkpoint RUN/checkpoints/step_N \
        --prompts humaneval.jsonl --max-prompts 8 --max-new-tokens 128 --types bf16 f32 q8_0 \
        --draft-max 3 7 15 --threads 1 2 --out runs/payoff
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from flashdraft.cli.engine import _prompt_ids
from flashdraft.eval.engine import (
    LlamaServer,
    ServerOptions,
    check_dflash_target,
    find_server,
    run_requests,
    tokens_per_second,
)
from flashdraft.export.formats import export_checkpoint
from flashdraft.export.gguf_target import served_target

WIDTHS = (1, 2, 4, 8, 16)


def forward_ms(server: LlamaServer, prompt: list[int], width: int, repeats: int = 5) -> float:
    """Median time of one target forward over `width` new tokens after `prompt` (cached)."""
    server.client.post("/completion", json={"prompt": prompt, "n_predict": 1, "cache_prompt": True})
    times = []
    for i in range(repeats):
        extra = [prompt[(i + j) % len(prompt)] for j in range(width)]
        body = {"prompt": prompt + extra, "n_predict": 1, "cache_prompt": True, "temperature": 0}
        timings = server.client.post("/completion", json=body).json()["timings"]
        times.append(timings["prompt_ms"] * width / max(timings["prompt_n"], 1))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target_help = "the target's .gguf, or an HF directory (converted into --out)"
    ap.add_argument("--target", type=Path, required=True, help=target_help)
    ap.add_argument("--checkpoint", type=Path, required=True, help="the drafter checkpoint (z-lab layout)")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--max-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--types", nargs="+", default=["bf16", "f32", "q8_0"])
    ap.add_argument("--draft-max", type=int, nargs="+", default=[3, 7, 15])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.target = served_target(args.target, args.out)  # as engine-check serves it
    check_dflash_target(args.target)
    binary = find_server()
    ids = _prompt_ids(args.target, args.prompts, args.max_prompts, False)
    ctx = max(len(x) for x in ids) + args.max_new_tokens + 64
    drafters = {}
    for kind in args.types:
        path = args.out / f"drafter.{kind}.gguf"
        drafters[kind] = (
            path
            if path.exists()
            else export_checkpoint(args.checkpoint, "gguf", path, str(args.target), gguf_type=kind)
        )
    rows = []
    for threads in args.threads:
        opts = ServerOptions(threads=threads, ctx_size=ctx)
        with LlamaServer(binary, args.target, None, args.out / f"plain.t{threads}.log", opts) as s:
            plain = tokens_per_second(run_requests(s, ids, args.max_new_tokens, 0))
            verify = {w: forward_ms(s, ids[0], w) for w in WIDTHS}
        token_ms = 1000 / plain
        print(f"threads {threads}: plain {plain:.1f} tokens/s; target forward over w tokens (ms): "
              + ", ".join(f"{w}: {ms:.1f}" for w, ms in verify.items()), flush=True)  # fmt: skip
        for kind, path in drafters.items():
            for n in args.draft_max:
                opts = ServerOptions(threads=threads, draft_max=n, ctx_size=ctx)
                log = args.out / f"{kind}.n{n}.t{threads}.log"
                with LlamaServer(binary, args.target, path, log, opts) as s:
                    requests = run_requests(s, ids, args.max_new_tokens, 0)
                tau = statistics.mean(r.tau for r in requests)
                steps, accepted = sum(r.steps for r in requests), sum(r.accepted for r in requests)
                tok_s = tokens_per_second(requests)
                step_ms = 1000 * (1 + accepted / steps) / tok_s
                width = min(n + 1, max(WIDTHS))
                verify_ms = verify.get(width)
                row = {"threads": threads, "type": kind, "draft_max": n, "tau": tau,
                       "tokens_per_s": tok_s, "plain_tokens_per_s": plain, "speedup": tok_s / plain,
                       "step_ms": step_ms, "token_ms": token_ms, "verify_ms": verify_ms,
                       "draft_ms": step_ms - verify_ms if verify_ms is not None else None}  # fmt: skip
                rows.append(row)
                print(f"  {kind:>5} n={n:<2} tau {tau:.2f}  {tok_s:7.1f} tok/s  {row['speedup']:.2f}x  "
                      f"step {step_ms:.1f} ms = verify {verify_ms or float('nan'):.1f} + draft "
                      f"{row['draft_ms'] or float('nan'):.1f}", flush=True)  # fmt: skip
    (args.out / "payoff.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
