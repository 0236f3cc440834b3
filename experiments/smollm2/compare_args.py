"""The `flashdraft compare` options that compare drafter variants on a SmolLM2 proof's data.

Prints the proof's target, data, prompt sets (HumanEval's first --humaneval problems and the held-out
synthesized turns, written to PROOF/held_out.jsonl) and the proof's drafter settings as --base options:

    flashdraft compare --out OUT $(python -m experiments.smollm2.compare_args PROOF) --steps 1000 \\
        --variant today --variant gamma:position_weights=gamma
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.smollm2.scales import H200
from flashdraft.demo.real_target import _write_lines, drafter_settings, prompt_split
from flashdraft.model.target import load_tokenizer


def compare_args(proof: Path, humaneval: int) -> list[str]:
    if not (proof / "data").is_dir():
        raise SystemExit(f"{proof} has no data/: run experiments.smollm2.proof --stop-after prepare first")
    _, held = prompt_split(proof, H200)
    held_path = _write_lines(proof / "held_out.jsonl", [{"messages": r["messages"]} for r in held])
    args = ["--target", str(proof / "target"), "--data", str(proof / "data")]
    args += ["--humaneval", str(humaneval), "--prompts", f"held_out={held_path}"]
    args += ["--preset", H200.preset, "--max-new-tokens", str(H200.eval_tokens), "--device", H200.device]
    args += ["--cuda-graphs"] if H200.cuda_graphs else []
    for key, value in drafter_settings(H200, load_tokenizer(proof / "target")).items():
        args += ["--base", f"{key}={json.dumps(value)}"]
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("proof", type=Path, help="a SmolLM2 proof directory after its prepare stage")
    ap.add_argument("--humaneval", type=int, default=64)
    args = ap.parse_args()
    print(" ".join(compare_args(args.proof, args.humaneval)))


if __name__ == "__main__":
    main()
