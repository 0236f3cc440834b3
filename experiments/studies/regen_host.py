"""The host work around one regeneration batch (flashdraft.data.regenerate.LocalBackend), on the CPU:
chat templates, tokenizing to tensors through torch or numpy, and decoding the answers row by row or as
one batch by the tokenizers backend. Medians of --reps after one warm-up; a BPE tokenizer trained on
the standard library, like the demo's, and random answer ids.

    python -m experiments.studies.regen_host --out OUT [--batch 8192 --answer-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashdraft.demo.pipeline import chat, code_windows, stdlib_files
from flashdraft.demo.tiny import build_tokenizer


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = [f.read_text(errors="replace") for f in stdlib_files()[:400]]
    tok = build_tokenizer(texts, vocab_size=args.vocab)
    windows = code_windows(texts, tok, 64, args.answer_tokens)
    convs = [chat(windows[i % len(windows)]["prompt"]) for i in range(args.batch)]
    prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    ids = torch.randint(0, args.vocab, (args.batch, args.answer_tokens)).tolist()
    options = dict(padding=True, padding_side="left", add_special_tokens=False, pad_to_multiple_of=32)

    def encode_numpy():
        return {k: torch.from_numpy(v) for k, v in tok(prompts, return_tensors="np", **options).items()}

    backend = tok.backend_tokenizer
    assert backend.decode_batch(ids[:64], skip_special_tokens=True) == [
        tok.decode(i, skip_special_tokens=True) for i in ids[:64]
    ]
    cases = {
        "chat templates": lambda: [
            tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs
        ],
        "encode, torch tensors": lambda: tok(prompts, return_tensors="pt", **options),
        "encode, numpy then torch": encode_numpy,
        "decode row by row": lambda: [tok.decode(i, skip_special_tokens=True) for i in ids],
        "decode one batch (tokenizers backend)": lambda: backend.decode_batch(ids, skip_special_tokens=True),
    }
    rows = [
        {"case": name, "batch": args.batch, "seconds": median_s(fn, args.reps)} for name, fn in cases.items()
    ]
    for r in rows:
        print(f"{r['case']:40s} {r['seconds']:.3f} s")
    (args.out / "regen_host.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
