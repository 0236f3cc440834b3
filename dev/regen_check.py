"""Which `data regenerate` local settings continue prompts as the target alone does: each attention
(grouped, the model's own) and cache (dynamic, static) regenerates the same prompts in one batch, and
each answer is compared with the target's batch-of-one greedy `generate`. On the H200 the Gemma 3 270M
proof's first regeneration (bf16, static cache, grouped attention, batches of 4096) wrote answers such as
"1. 1. 1. ..." where the target alone completes code; this finds the setting at fault.

    PYTHONPATH=src python3 dev/regen_check.py TARGET_DIR PROMPTS.jsonl [--prompts 32] [--tokens 48]
"""

import argparse
import copy
import json
from pathlib import Path

import torch

from flashdraft.data.regenerate import LocalBackend
from flashdraft.data.tokenize import prompt_ids
from flashdraft.model.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("prompts", help='JSONL of {"prompt"} records')
    ap.add_argument("--prompts-n", "--prompts", dest="n", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bf16 on a GPU, f32 on a CPU")
    ap.add_argument("--caches", default="dynamic,static", help="the caches to try, comma-separated")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tok = load_target(args.target, args.device, dtype=dtype)
    lines = Path(args.prompts).read_text().splitlines()[: args.n]
    prompts = [json.loads(line)["prompt"] for line in lines]
    stop = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    alone = []
    for p in prompts:
        ids = torch.tensor([prompt_ids(tok, p)], device=model.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, do_sample=False, **stop
        )
        alone.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    print(f"{model.dtype}, {len(prompts)} prompts, {args.tokens} tokens; alone, first: {alone[0][:60]!r}")
    convs = [[{"role": "user", "content": p}] for p in prompts]
    for attention in ("grouped", None):
        for cache in args.caches.split(","):
            backend = LocalBackend(
                copy.deepcopy(model), tok, args.tokens, 0.0, len(convs), cache=cache, attention=attention
            )
            got = [text for text, _ in backend._generate(backend._encode(convs), len(convs))]
            same = sum(g == a for g, a in zip(got, alone, strict=True))
            print(f"{backend.attention_name:>24} {cache:>8}: {same}/{len(got)} equal; first: {got[0][:60]!r}")


if __name__ == "__main__":
    main()
