"""One decoding step's attention at the regeneration's shapes, per kernel of
flashdraft.model.grouped_attention and transformers' repeat_kv sdpa, compiled as generate compiles it.

Reports the median time per call and the key/value bytes read per second (the cache is read once per
call at best; an H200 streams ~4.3 TB/s), to show which kernel reads the grouped cache at bandwidth.

    python benchmarks/decode_attention.py --out runs/decode_attention [--batch 8192 --length 192]
        [--cache-update]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from flashdraft.model.grouped_attention import KERNELS


def repeat_kv_sdpa(query, key, value, mask, scale):  # what transformers' compiled sdpa path runs
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=scale
    )


def with_cache_update(attend):
    """The step as transformers' StaticCache runs it: the new token's key and value written into the
    cache in place (index_copy_ at its position), then attention over the whole cache."""

    def step(query, key_new, value_new, key, value, position, mask, scale):
        key.index_copy_(2, position, key_new)
        value.index_copy_(2, position, value_new)
        return attend(query, key, value, mask, scale)

    return step


def median_ms(fn, args, reps: int, cuda: bool = True) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        if not cuda:  # --device cpu: checks the script, times nothing that matters
            t = time.perf_counter()
            fn(*args)
            times.append(1e3 * (time.perf_counter() - t))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--length", type=int, default=192, help="the static cache's length")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script only")
    parser.add_argument(
        "--cache-update",
        action="store_true",
        help="also write the new token into the cache inside the compiled function, as a static cache does",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    b, s, d = args.batch, args.length, args.dim
    dev = args.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    q = torch.randn(b, args.heads, 1, d, device=dev, dtype=dt)
    k = torch.randn(b, args.kv_heads, s, d, device=dev, dtype=dt)
    v = torch.randn(b, args.kv_heads, s, d, device=dev, dtype=dt)
    # left padding of up to 32 tokens, and the static cache written up to 3/4 of its length
    pos = torch.arange(s, device=dev)
    pad = torch.randint(0, 32, (b, 1), device=dev)
    mask = ((pos >= pad) & (pos < 3 * s // 4))[:, None, None, :]
    scale = d**-0.5
    kv_bytes = 2 * k.numel() * k.element_size()
    reference = repeat_kv_sdpa(q.float(), k.float(), v.float(), mask, scale)
    rows = []
    for name, fn in {"repeat_kv_sdpa": repeat_kv_sdpa, **KERNELS}.items():
        row = {"kernel": name, "batch": b, "length": s}
        inputs = (q, k, v, mask, scale)
        if args.cache_update:  # the token written where the reference already holds it
            fn, row["cache_update"] = with_cache_update(fn), True
            k_static, v_static = k.clone(), v.clone()
            for t in (k_static, v_static):
                torch._dynamo.mark_static_address(t)  # as transformers marks its cache
            at = torch.tensor([3 * s // 4 - 1], device=dev)
            new_kv = (k[:, :, at], v[:, :, at])
            inputs = (q, *new_kv, k_static, v_static, at, mask, scale)
        try:
            compiled = torch.compile(fn, dynamic=False)
            out = compiled(*inputs)
            row["max_abs_err"] = (out.float() - reference).abs().max().item()
            row["ms"] = median_ms(compiled, inputs, args.reps, cuda=dev == "cuda")
            row["kv_GB_s"] = kv_bytes / row["ms"] / 1e6
        except Exception as e:  # a kernel that does not compile is a result too
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(row, flush=True)
    (args.out / "decode_attention.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
