"""How fast a mixture-of-experts target's expert GEMMs can run: `torch._grouped_mm` as the target forward
calls it, against the same FLOPs as one dense matmul. The bound on what faster expert GEMMs could give
the target forward, measured before any are written.

For a bench shape with experts (qwen3-30b-a3b: 128 experts of 768, top-8, width 2,048), with --rows x
3,072 tokens routed, each of the two expert GEMMs (gate/up: K = width, N = 2 x the expert's width;
down: K = the expert's width, N = width) is timed:

- grouped, routed: `_grouped_mm` over the rows sorted by expert, group sizes from routing random
  tokens through a random router with a softmax top-k, the weights in transformers' layout
  ([experts, N, K], transposed to [experts, K, N] as its grouped linear passes them);
- grouped, even: the same with every expert given the same number of rows;
- grouped, routed, padded: the routed groups each padded to a multiple of 128 rows (the GEMM's tile),
  its rate counted on the routed rows' FLOPs: what padding the sorted rows would give;
- grouped, [experts, K, N] contiguous: the other weight layout;
- dense: one [tokens x top-k, K] @ [K, N] matmul, the same FLOPs, one weight;
- triton BMxBN: a persistent Triton grouped GEMM over the padded groups, each block of BM rows one
  expert's, its operands loaded by TMA (tensor descriptors; Hopper and later), at a few tile shapes.
  Its output is checked against the padded `_grouped_mm`'s. Where torch's grouped GEMM falls short
  of a dense matmul's rate, whether one of our own can close the gap.

Each figure is the median of --iters CUDA-event timings after warm-up, with its TFLOP/s and share of the
bf16 matmul peak measured in the same run. GPU only; where triton is installed `--device cpu` checks
the script, and with TRITON_INTERPRET=1 also the Triton kernel, in fp32 (the interpreter's bf16
products are wrong): `TRITON_INTERPRET=1 python benchmarks/moe_gemms.py --device cpu --experts 16
--rows 1 --seq-len 128 --iters 2`, under a minute.

    python benchmarks/moe_gemms.py [--shape qwen3-30b-a3b] [--rows 2] [--iters 20]
"""

import argparse
import os

import torch
import triton
import triton.language as tl
from decode_attention import median_ms
from triton.tools.tensor_descriptor import TensorDescriptor

from flashdraft.bench import shape_config
from flashdraft.train.flops import matmul_tflops


def routed_offsets(tokens: int, experts: int, top_k: int, width: int, device: str) -> torch.Tensor:
    """Cumulative rows per expert, from random tokens through a random router (softmax top-k)."""
    hidden = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    router = torch.randn(width, experts, device=device, dtype=torch.bfloat16) * width**-0.5
    chosen = (hidden @ router).float().softmax(-1).topk(top_k, dim=-1).indices
    counts = torch.bincount(chosen.flatten(), minlength=experts)
    return torch.cumsum(counts, 0, dtype=torch.int32)


def padded_offsets(offsets: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """offsets with each group's rows rounded up to a multiple of tile."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return torch.cumsum((counts + tile - 1) // tile * tile, 0, dtype=torch.int32)


TRITON_TILES = ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 256, 64, 4, 4))  # BM, BN, BK, warps, stages


@triton.jit
def _grouped(
    a_desc,
    w_desc,
    c_desc,
    block_expert,
    m_blocks: tl.constexpr,
    sms: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Persistent: program p takes tiles p, p + sms, ...; a tile is one m-block (one expert's rows) by one
    n-block of that expert's weight [N, K]. m_blocks is a constant here (fixed routing); a target forward
    would take it at run time."""
    n_blocks: tl.constexpr = N // BN
    for first in tl.range(0, m_blocks * n_blocks, sms):  # constant bounds: the interpreter takes no others
        t = first + tl.program_id(0)
        if t < m_blocks * n_blocks:
            mb, nb = t // n_blocks, t % n_blocks  # an m-block's n-blocks in turn: its rows stay in L2
            expert = tl.load(block_expert + mb)
            acc = tl.zeros((BM, BN), tl.float32)
            for k in range(0, K, BK):
                x = a_desc.load([mb * BM, k])
                w = w_desc.load([expert * N + nb * BN, k])
                acc = tl.dot(x, w.T, acc)
            c_desc.store([mb * BM, nb * BN], acc.to(c_desc.dtype))


def triton_grouped(a, stored, padded, tile):
    """A launcher of a [padded rows, K] @ stored[e]^T for each padded group's rows (stored [experts, N,
    K]), and its output [padded rows, N]."""
    bm, bn, bk, warps, stages = tile
    experts, n, k = stored.shape
    rows = a.shape[0]
    assert n % bn == 0 and k % bk == 0 and rows % bm == 0, (n, k, rows, tile)
    starts = torch.arange(0, rows, bm, device=a.device, dtype=torch.int32)
    block_expert = torch.searchsorted(padded, starts, right=True).to(torch.int32)  # no host sync
    out = torch.empty(rows, n, device=a.device, dtype=a.dtype)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(stored.view(experts * n, k), [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    grid = (min(sms, rows // bm * (n // bn)),)

    def run():
        _grouped[grid](a_desc, w_desc, c_desc, block_expert, rows // bm, sms, n, k, bm, bn, bk,
                       num_warps=warps, num_stages=stages)  # fmt: skip
        return out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--rows", type=int, default=2, help="rows of 3,072 tokens a step")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: checks the script, times nothing that matters")
    parser.add_argument("--experts", type=int, help="fewer experts than the shape's (a quick check)")
    args = parser.parse_args()
    c = shape_config(args.shape)
    experts, top_k, width = args.experts or c.num_experts, c.num_experts_per_tok, c.hidden_size
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    dtype = torch.float32 if interpreted else torch.bfloat16
    inner = c.moe_intermediate_size
    tokens = args.rows * args.seq_len
    m = tokens * top_k
    dev = args.device
    peak = matmul_tflops(torch.device(dev))
    routed = routed_offsets(tokens, experts, top_k, width, dev)
    even = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * (m // experts)
    padded = padded_offsets(routed)
    print(f"{args.shape}: {tokens} tokens x top-{top_k} = {m} rows over {experts} experts")
    per_expert = torch.diff(routed, prepend=routed.new_zeros(1))
    low, high = int(per_expert.min()), int(per_expert.max())
    print(f"routed rows an expert: min {low}, max {high}, mean {m / experts:.0f}")
    print(f"bf16 matmul peak, measured: {peak:.1f} TFLOP/s\n")
    print(f"{'gemm':8s} {'variant':28s} {'ms':>8s} {'TFLOP/s':>9s} {'of peak':>8s}")
    for name, k, n in (("gate/up", width, 2 * inner), ("down", inner, width)):
        a = torch.randn(int(padded[-1]), k, device=dev, dtype=dtype)  # the padded rows' room
        stored = torch.randn(experts, n, k, device=dev, dtype=dtype) * k**-0.5  # transformers' layout
        contiguous = stored.transpose(-2, -1).contiguous()
        dense = contiguous[0]
        flops = 2 * m * k * n
        cases = {
            "grouped, routed": (torch._grouped_mm, (a[:m], stored.transpose(-2, -1)), {"offs": routed}),
            "grouped, even": (torch._grouped_mm, (a[:m], stored.transpose(-2, -1)), {"offs": even}),
            "grouped, routed, padded": (torch._grouped_mm, (a, stored.transpose(-2, -1)), {"offs": padded}),
            "grouped, [E, K, N] stored": (torch._grouped_mm, (a[:m], contiguous), {"offs": routed}),
            "dense, one weight": (torch.mm, (a[:m], dense), {}),
        }
        want = torch._grouped_mm(a, stored.transpose(-2, -1), offs=padded).float()
        for tile in TRITON_TILES if dev == "cuda" or interpreted else ():
            run = triton_grouped(a, stored, padded, tile)
            err = ((run().float() - want).norm() / want.norm()).item()
            print(f"{name:8s} triton {tile}: relative error {err:.1e}")
            assert err < 1e-2, (name, tile, err)
            cases[f"triton {tile[0]}x{tile[1]}"] = (run, (), {})
        if interpreted:
            continue  # the kernel checked; the interpreter times nothing
        for variant, (fn, fn_args, kw) in cases.items():
            ms = median_ms(
                lambda fn=fn, fn_args=fn_args, kw=kw: fn(*fn_args, **kw), (), args.iters, dev == "cuda"
            )
            rate = flops / ms / 1e9
            print(f"{name:8s} {variant:28s} {ms:8.3f} {rate:9.1f} {rate / peak:8.1%}")


if __name__ == "__main__":
    main()
