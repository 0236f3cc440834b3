"""The conformance matrix's target side on a GPU: every tiny family of tests/families.py in bf16 on CUDA
(the kernels training uses there), through the packing probe, the leak test and greedy decoding.

    python benchmarks/family_probe.py [--device cuda] [--dtype bfloat16] [--train OUT]

One line per family: the packing `choose_packing` picked and how long the probe took, the largest
difference between a packed row's features and each document's features alone (bf16 rounding, where the
documents are kept apart), and how many of 4 prompts speculative decoding (a random drafter) reproduced
the target's own greedy output token for token. With --train, each family's tiny target is also saved
under OUT with the tests' tokenizer and trained for 3 steps by `flashdraft train` on packed data, with
the defaults of that device (on a GPU: compiled drafter, flex attention, compiled target layers), then
measured by `flashdraft eval`: its exit status, last loss, and how many outputs equal plain decoding.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import families  # noqa: E402
from flashdraft.data.packing import collate_rows, pack_documents, save_token_dataset  # noqa: E402
from flashdraft.demo.tiny import build_tokenizer, save_target, stdlib_files  # noqa: E402
from flashdraft.eval.spec import DFlashProposer, generate  # noqa: E402
from flashdraft.model.drafter import DFlashDrafter, drafter_config  # noqa: E402
from flashdraft.model.target import Target, choose_packing  # noqa: E402
from flashdraft.train.build import init_drafter_  # noqa: E402
from flashdraft.train.step import target_features  # noqa: E402

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


def train_and_eval(name: str, out: Path, tokenizer, device: str) -> str:
    """`flashdraft train` (3 steps) and `flashdraft eval` (2 prompts) on the family's tiny target."""
    root = out / name
    model = families.build(name, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    save_target(model, tokenizer, root / "target")
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (30, 45, 60, 38, 52, 41, 33, 57) * 2]
    save_token_dataset(
        [{"input_ids": d, "loss_mask": [0] * 6 + [1] * (len(d) - 6)} for d in docs], root / "data"
    )
    # head size 16: flex_attention's smallest on a GPU
    drafter = {
        "num_layers": 2,
        "num_taps": 2,
        "block_size": 8,
        "head_dim": 16,
        **families.DRAFTER_SHAPES.get(name, {}),
    }
    config = {"drafter": drafter, "data": {"seq_len": 128, "rows_per_batch": 2}, "num_anchors": 8,
              "max_steps": 3, "log_every": 1}  # fmt: skip
    (root / "train.json").write_text(json.dumps(config))  # YAML is a superset of JSON
    cli = [sys.executable, "-m", "flashdraft.cli.main"]
    train = [*cli, "train", "--target", str(root / "target"), "--data", str(root / "data"), "--out",
             str(root / "run"), "--config", str(root / "train.json"), "--device", device]  # fmt: skip
    proc = subprocess.run(train, capture_output=True, text=True)
    (root / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return f"| {name} | train exit {proc.returncode} | | |"
    loss = json.loads((root / "run" / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    (root / "prompts.jsonl").write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    ckpt = root / "run" / "checkpoints" / (root / "run" / "checkpoints" / "LATEST").read_text().strip()
    report = root / "report.json"
    evaluate = [*cli, "eval", "--target", str(root / "target"), "--drafter", str(ckpt), "--prompts",
                str(root / "prompts.jsonl"), "--out", str(report), "--max-new-tokens", "32",
                "--device", device]  # fmt: skip
    proc = subprocess.run(evaluate, capture_output=True, text=True)
    (root / "eval.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return f"| {name} | train ok, loss {loss:.3f} | eval exit {proc.returncode} | |"
    same = json.loads(report.read_text())["identical_to_autoregressive"]
    return f"| {name} | ok, loss {loss:.3f} | ok | {same['dflash']}/{same['of']} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--train", type=Path, help="also train and eval each family's target under this dir")
    parser.add_argument("--families", default=",".join(families.FAMILIES), help="comma-separated names")
    args = parser.parse_args()
    names = args.families.split(",")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{gpu}, {dtype}, torch {torch.__version__}")
    print("| family | packing | probe | packed vs alone (max rel.) | greedy = target's |")
    print("|---|---|---|---|---|")
    for name in names:
        print(check(name, device, dtype), flush=True)
    if args.train:
        tokenizer = build_tokenizer([p.read_text(errors="replace") for p in stdlib_files(limit=30)], 384)
        print("\n| family | flashdraft train | flashdraft eval | DFlash output = plain decoding |")
        print("|---|---|---|---|")
        for name in names:
            print(train_and_eval(name, args.train, tokenizer, args.device), flush=True)


if __name__ == "__main__":
    main()
