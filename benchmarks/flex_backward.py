"""flex_attention forward and backward at the drafter's shape, for a few kernel tile settings.

    python benchmarks/flex_backward.py            # the qwen3-8b bench shape: 512 anchors, 3072 context,
                                                  # six documents of 512 tokens
    python benchmarks/flex_backward.py --documents 1 --settings default s2 "64 s2"

`flashdraft bench --profile` put the drafter's attention backward at 20.6 ms a step (5 layers) against
4.4 ms forward on the H200: 4.7 times the forward, where its FLOPs are 2.5 times. This times the same
call (the structured block mask of one row of random anchors, drawn as training draws them from
`--documents` documents of equal length; 32 query heads over 8 key/value heads of 128) with torch's
default tiles and with the `kernel_options` listed, medians of CUDA-event timings after a warm-up, and
checks each setting's gradients against the first's.

A setting named "64 ..." builds the block mask of 64-token tiles instead of 128 (4 draft blocks a query
tile, not 8): a draft block's own keys then fill a quarter of their tile instead of an eighth, and the
last context tile of a block's range wastes half as much, for smaller matmuls. Its kernel tiles must
divide 64.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention.flex_attention import flex_attention

from flashdraft.train.blocks import sample_anchors, structured_block_mask


def _bwd(m1: int, n1: int, m2: int, n2: int, stages: int, warps: int) -> dict:
    return {
        "bwd_BLOCK_M1": m1,
        "bwd_BLOCK_N1": n1,
        "bwd_BLOCK_M2": m2,
        "bwd_BLOCK_N2": n2,
        "bwd_num_stages": stages,
        "bwd_num_warps": warps,
    }


# torch's default on sm90 at head_dim 128 is (64, 128, 128, 64), 3 stages, 8 warps
SETTINGS = {
    "default": None,
    "TMA": {"USE_TMA": True},
    "64/128 s3 w4": _bwd(64, 128, 128, 64, 3, 4),
    "32/128 s3 w4": _bwd(32, 128, 128, 32, 3, 4),
    "64/64 s3 w4": _bwd(64, 64, 64, 64, 3, 4),
    "32/64 s3 w4": _bwd(32, 64, 64, 32, 3, 4),
    "64/128 s2 w8": _bwd(64, 128, 128, 64, 2, 8),
    "128/128 s2 w8": _bwd(128, 128, 128, 128, 2, 8),
    "s2": {"bwd_num_stages": 2},  # the drafter's setting on CUDA (model/drafter.py CUDA_FLEX_OPTIONS)
    "TMA s2": {"USE_TMA": True, "bwd_num_stages": 2},
    "64 s2": {"BLOCK_M": 64, "BLOCK_N": 64, **_bwd(64, 64, 64, 64, 2, 8)},
    "64 32/64 s3 w4": {"BLOCK_M": 64, "BLOCK_N": 64, **_bwd(32, 64, 64, 32, 3, 4)},
    "64 32/64 s2 w4": {"BLOCK_M": 64, "BLOCK_N": 64, **_bwd(32, 64, 64, 32, 2, 4)},
    "64 TMA 32/64 s3 w4": {"USE_TMA": True, "BLOCK_M": 64, "BLOCK_N": 64, **_bwd(32, 64, 64, 32, 3, 4)},
}  # fmt: skip


def _tile(setting: str) -> int:
    return 64 if setting.startswith("64 ") else 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--documents", type=int, default=6, help="documents of equal length in the row")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--settings", nargs="*", choices=list(SETTINGS), default=list(SETTINGS))
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    s, n, bs = args.seq_len, args.anchors, args.block_size
    doc_ids, positions = documents(s, args.documents, dev)
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(torch.ones_like(doc_ids), doc_ids, bs, n, gen)
    masks = {t: structured_block_mask(anchors, doc_ids, bs, tile=t) for t in (64, 128)}
    q_len, kv_len = n * bs, s + n * bs
    q = torch.randn(1, args.heads, q_len, args.head_dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, args.kv_heads, kv_len, args.head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    grad_out = torch.randn_like(q)
    # the FLOPs the mask leaves: 2 matmuls of 2 * d per visible (query, key) pair forward, 5 backward;
    # a block sees its document's tokens before the anchor and its own block
    seen = positions.gather(1, anchors.index) + bs
    visible = int(seen[anchors.valid].sum()) * bs
    fwd_flops = 4 * args.heads * args.head_dim * visible
    torch._dynamo.config.recompile_limit = 64  # one compile per setting
    attend = torch.compile(flex_attention, dynamic=False)
    reference = None
    print(f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, {visible / (q_len * kv_len):.1%} of pairs visible")
    print(f"{'setting':20s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TFLOP/s':>12s} {'bwd TFLOP/s':>12s}  grads")
    for name in args.settings:  # the first is the reference the others' gradients are checked against
        options = SETTINGS[name]
        try:
            f, b, grads = _time(attend, (q, k, v), grad_out, masks[_tile(name)], options, args.iters)
        except Exception as err:  # a tile setting the GPU cannot run (shared memory): report, go on
            print(f"{name:20s} failed: {str(err).splitlines()[0][:90]}")
            continue
        if reference is None:
            reference, check = grads, "reference"
        else:
            pairs = zip(grads, reference, strict=True)
            same = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in pairs)
            check = "equal" if same else "DIFFER"
        rates = f"{fwd_flops / f / 1e9:12.1f} {2.5 * fwd_flops / b / 1e9:12.1f}"
        print(f"{name:20s} {f:8.3f} {b:8.3f} {rates}  {check}")


def documents(seq_len: int, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """doc_ids and position ids [1, seq_len] of `count` documents of equal length (the last takes the
    remainder), as `flashdraft bench` lays out its rows."""
    length = seq_len // count
    lengths = torch.tensor([length] * (count - 1) + [seq_len - length * (count - 1)])
    doc_ids = torch.repeat_interleave(torch.arange(count), lengths)
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    positions = torch.arange(seq_len) - starts
    return doc_ids[None].to(device), positions[None].to(device)


def _time(attend, qkv, grad_out, mask, options, iters: int):
    """Median forward and backward milliseconds (CUDA events, after 3 warm-up calls) and the gradients.
    A sleep is queued before each timed call: without it the forward column moves by up to 30% between
    settings that share the forward kernel, because the host's launch time is included."""
    leaves = [t.detach().requires_grad_() for t in qkv]
    fwd_ms, bwd_ms = [], []
    for i in range(iters + 3):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda._sleep(2_000_000)  # about a millisecond of GPU work queued first: the events time the
        e[0].record()  # kernels, not the host's launch (the GPU would otherwise wait for it, idle)
        out = attend(*leaves, block_mask=mask, enable_gqa=True, kernel_options=options)
        e[1].record()
        grads = torch.autograd.grad(out, leaves, grad_out)
        e[2].record()
        torch.cuda.synchronize()
        if i >= 3:
            fwd_ms.append(e[0].elapsed_time(e[1]))
            bwd_ms.append(e[1].elapsed_time(e[2]))
    return statistics.median(fwd_ms), statistics.median(bwd_ms), grads


if __name__ == "__main__":
    main()
