"""Several training processes started at once on a cold compile cache, all on one device.

The pipeline flashdraft replaces ran one thread per GPU, each compiling flex_attention: on a cold
cache three threads hung. flashdraft runs one process per rank; this starts N ranks at once
(`flashdraft train --nproc N`, gloo, every rank on the same GPU when FLASHDRAFT_SHARE_GPU=1) with
an empty inductor cache and reports whether all of them compiled and trained, and how long it took.

    python -m experiments.studies.shared_gpu_cold_start --nproc 3 [--device cuda] [--layout split:1:2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.data.packing import save_token_dataset
from flashdraft.demo.tiny import build_tiny_target, build_tokenizer, save_target, stdlib_files


def make_run_inputs(root: Path) -> tuple[Path, Path]:
    tokenizer = build_tokenizer([p.read_text(errors="replace") for p in stdlib_files(30)], vocab_size=384)
    torch.manual_seed(0)
    target = save_target(build_tiny_target(tokenizer), tokenizer, root / "target")
    g = torch.Generator().manual_seed(0)
    docs = []
    for n in [200, 240, 180, 256] * 8:
        ids = torch.randint(0, len(tokenizer) - 1, (n,), generator=g).tolist()
        docs.append({"input_ids": ids, "loss_mask": [0] * 16 + [1] * (n - 16)})
    save_token_dataset(docs, root / "data")
    return target, root / "data"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layout", default="colocated", help="colocated or split:T:D (T + D = nproc)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="flashdraft-cold-"))
    target, data = make_run_inputs(root)
    (root / "cfg.yaml").write_text(
        "data: {seq_len: 256, rows_per_batch: 1}\nnum_anchors: 16\nlog_every: 1\ncompile: true\n"
        "drafter: {num_layers: 2, num_taps: 2}\n"
    )
    env = {**os.environ, "FLASHDRAFT_SHARE_GPU": "1", "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
    cmd = [sys.executable, "-m", "flashdraft.cli.main", "train", "--target", str(target), "--data", str(data),
           "--out", str(root / "run"), "--config", str(root / "cfg.yaml"), "--max-steps", str(args.steps),
           "--device", args.device, "--nproc", str(args.nproc), "--backend", "gloo",
           "--layout", args.layout]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    compile_lines = [line for line in proc.stdout.splitlines() if "compile:" in line]
    metrics = (root / "run" / "metrics.jsonl").read_text().splitlines() if proc.returncode == 0 else []
    result = {
        "nproc": args.nproc,
        "layout": args.layout,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "steps_logged": len(metrics),
        "compile": compile_lines,
    }
    print(json.dumps(result, indent=2))
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        print("\n".join(errors[:20]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
