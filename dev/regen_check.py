"""Which `data regenerate` local settings continue prompts as the target alone does: each setting
(attention: grouped or the model's sdpa; cache: dynamic, static, or static with transformers' automatic
compile of the decoding step turned off) regenerates the same prompts in batches of --batch, and each
answer is compared with the target's batch-of-one greedy `generate`. On the H200 the Gemma 3 270M proof's
first regeneration (bf16, static cache, grouped attention, batches of 4096) wrote answers such as
"1. 1. 1. ..." and many empty ones where the target alone completes code; this finds the setting at fault.

    PYTHONPATH=src python3 dev/regen_check.py TARGET_DIR PROMPTS.jsonl [PROMPTS.jsonl ...] \
        [--prompts 32] [--tokens 48] [--batch 64] [--settings grouped:static,sdpa:dynamic,...]
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from flashdraft.data.regenerate import LocalBackend
from flashdraft.data.tokenize import prompt_ids
from flashdraft.model.target import load_target

SETTINGS = "grouped:static,grouped:static-eager,none:static,none:static-eager,grouped:dynamic,none:dynamic"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("prompts", nargs="+", help='JSONL files of {"prompt"} records')
    ap.add_argument("--prompts-n", "--prompts", dest="n", type=int, default=32, help="from each file")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, help="regeneration batch (static: filled with copies); default all")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bf16 on a GPU, f32 on a CPU")
    ap.add_argument("--settings", default=SETTINGS, help="ATTENTION:CACHE pairs, comma-separated")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tok = load_target(args.target, args.device, dtype=dtype)
    prompts = []
    for path in args.prompts:
        lines = Path(path).read_text().splitlines()[: args.n]
        prompts += [json.loads(line)["prompt"] for line in lines]
    stop = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    alone = []
    for p in prompts:
        ids = torch.tensor([prompt_ids(tok, p)], device=model.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, do_sample=False, **stop
        )
        alone.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    empty = sum(not a.strip() for a in alone)
    print(f"{model.dtype}, {len(prompts)} prompts, {args.tokens} tokens; alone: {empty} empty")
    convs = [[{"role": "user", "content": p}] for p in prompts]
    batch = args.batch or len(convs)
    for setting in args.settings.split(","):
        attention, cache = setting.split(":")
        backend = LocalBackend(
            copy.deepcopy(model), tok, args.tokens, 0.0, batch, cache=cache.removesuffix("-eager"),
            attention=None if attention == "none" else attention,
        )  # fmt: skip
        backend.generation_config.disable_compile = cache.endswith("-eager")
        start, got = time.perf_counter(), []
        for i in range(0, len(convs), batch):
            chunk = convs[i : i + batch]
            got += [text for text, _ in backend._generate(backend._encode(chunk), len(chunk))]
        seconds = time.perf_counter() - start
        same = sum(g == a for g, a in zip(got, alone, strict=True))
        bad = next((g for g, a in zip(got, alone, strict=True) if g != a), "")
        empty = sum(not g.strip() for g in got)
        print(f"{backend.attention_name:>22} {cache:>13}: {same}/{len(got)} equal, {empty} empty, "
              f"{seconds:.1f} s; first unequal {bad[:50]!r}")  # fmt: skip


if __name__ == "__main__":
    main()
