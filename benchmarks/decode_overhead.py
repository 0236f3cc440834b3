"""Time per output token of the eval loop, dynamic cache vs fixed-shape caches (CUDA graphs).

Random weights of a named target shape (flashdraft bench's shapes) and a random drafter, so this
measures the loop's cost, not acceptance: plain decoding, DFlash and n-gram on the same prompts,
once with the cropped DynamicCache and once with `cuda_graphs=True` (flashdraft.eval.static), with
the medians per method, the speedup of the graphs, and how many greedy outputs the two paths share
(bf16 attention over a padded static cache may round differently).

    python benchmarks/decode_overhead.py --shape proof-95m --out runs/decode [--prompts 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashdraft.bench import random_target, shape_config
from flashdraft.eval.spec import METHODS, decoding_target, run_methods
from flashdraft.model.drafter import DFlashDrafter, drafter_config
from flashdraft.train.build import init_drafter_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="proof-95m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=90)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--drafter-layers", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    tcfg = shape_config(args.shape)
    model = random_target(tcfg, device, dtype)
    taps = min(5, tcfg.num_hidden_layers - 3)
    drafter = DFlashDrafter(drafter_config(tcfg, args.drafter_layers, None, taps, 16, tcfg.vocab_size - 1))
    init_drafter_(drafter, std=0.02, seed=0)
    drafter = drafter.to(device, dtype).eval()
    target = decoding_target(model, drafter)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, tcfg.vocab_size - 1, (args.prompt_tokens,), generator=g).tolist()
        for _ in range(args.prompts)
    ]

    rows, outputs = {}, {}
    for graphs in (False, True):
        t = time.perf_counter()
        results = run_methods(target, drafter, prompts, args.new_tokens, 16, cuda_graphs=graphs)
        wall = time.perf_counter() - t
        outputs[graphs] = {m: [gen.tokens for gen in gens] for m, gens in results.items()}
        for m in METHODS:
            per_token = [gen.decode_s / (len(gen.tokens) - 1) for gen in results[m]]
            cycles = [gen.decode_s / len(gen.accept_lengths) for gen in results[m]]
            rows[(m, graphs)] = {
                "ms_per_token": 1e3 * statistics.median(per_token),
                "ms_per_cycle": 1e3 * statistics.median(cycles),
            }
        rows[("all", graphs)] = {"wall_s": wall}
    same = {m: sum(a == b for a, b in zip(outputs[False][m], outputs[True][m], strict=True)) for m in METHODS}
    report = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "rows": {f"{m}/{'graphs' if gr else 'dynamic'}": v for (m, gr), v in rows.items()},
        "identical_outputs": same | {"of": args.prompts},
    }
    (args.out / "decode_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'method':16} {'dynamic ms/token':>18} {'graphs ms/token':>16} {'speedup':>8}")
    for m in METHODS:
        d, c = rows[(m, False)]["ms_per_token"], rows[(m, True)]["ms_per_token"]
        print(f"{m:16} {d:18.2f} {c:16.2f} {d / c:7.1f}x")
    print(f"wall s: dynamic {rows[('all', False)]['wall_s']:.1f}, graphs {rows[('all', True)]['wall_s']:.1f}")
    print(f"outputs identical between the paths: {same} of {args.prompts}")


if __name__ == "__main__":
    main()
