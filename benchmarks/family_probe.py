"""The conformance matrix's target side on a GPU: every tiny family of tests/families.py in bf16 on CUDA
(the kernels training uses there), through the packing probe, the leak test and greedy decoding.

    python benchmarks/family_probe.py [--device cuda] [--dtype bfloat16]

One line per family: the packing `choose_packing` picked and how long the probe took, the largest
difference between a packed row's features and each document's features alone (bf16 rounding, where the
documents are kept apart), and how many of 4 prompts speculative decoding (a random drafter) reproduced
the target's own greedy output token for token.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import families  # noqa: E402
from flashdraft.data.packing import collate_rows, pack_documents  # noqa: E402
from flashdraft.eval.spec import DFlashProposer, generate  # noqa: E402
from flashdraft.model.drafter import DFlashDrafter, drafter_config  # noqa: E402
from flashdraft.model.target import Target, choose_packing  # noqa: E402
from flashdraft.train.step import target_features  # noqa: E402
from flashdraft.train.trainer import init_drafter_  # noqa: E402

VOCAB, EOS, PAD, MASK = 384, 2, 0, 3


def check(name: str, device: torch.device, dtype: torch.dtype) -> str:
    model = families.build(name, VOCAB, EOS, PAD).to(device, dtype)
    dcfg = drafter_config(model.config, 2, None, 2, 8, MASK)
    t0 = time.perf_counter()
    packing = choose_packing(model, dcfg.target_layer_ids)
    probe_s = time.perf_counter() - t0
    target = Target(model, dcfg.target_layer_ids, packing=packing)
    g = torch.Generator().manual_seed(0)
    docs = [
        {"input_ids": torch.randint(4, VOCAB, (n,), generator=g).tolist(), "loss_mask": [1] * n}
        for n in (20, 27)
    ]
    rows = pack_documents([20, 27], 64, [0, 1], packing == "one_document")
    feats = target_features(target, collate_rows([[docs[i] for i in r] for r in rows], 64, PAD).to(device))
    worst = 0.0
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(docs[i]["input_ids"])
            alone = target.features(torch.tensor([docs[i]["input_ids"]], device=device))[0]
            worst = max(worst, float((feats[r, start : start + n] - alone).abs().max() / alone.abs().max()))
            start += n
    drafter = DFlashDrafter(dcfg)
    init_drafter_(drafter, 0.1, seed=0)
    drafter = drafter.to(device, dtype).eval()
    same = 0
    for _ in range(4):
        ids = torch.randint(4, VOCAB, (1, 10), generator=g).to(device)
        with torch.no_grad():  # transformers' greedy generate, which stops at the end-of-sequence token
            hf = model.generate(ids, max_new_tokens=24, do_sample=False)[0, 10:].tolist()
        same += (
            generate(target, ids, 24, DFlashProposer(drafter, target), 8, stop_token_ids=[EOS]).tokens == hf
        )
    return f"| {name} | {packing} | {probe_s:.2f} s | {worst:.1e} | {same}/4 |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{gpu}, {dtype}, torch {torch.__version__}")
    print("| family | packing | probe | packed vs alone (max rel.) | greedy = target's |")
    print("|---|---|---|---|---|")
    for name in families.FAMILIES:
        print(check(name, device, dtype), flush=True)


if __name__ == "__main__":
    main()
