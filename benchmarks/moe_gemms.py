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
- dense: one [tokens x top-k, K] @ [K, N] matmul, the same FLOPs, one weight.

Each figure is the median of --iters CUDA-event timings after warm-up, with its TFLOP/s and share of the
bf16 matmul peak measured in the same run. GPU only (--device cpu checks the script).

    python benchmarks/moe_gemms.py [--shape qwen3-30b-a3b] [--rows 2] [--iters 20]
"""

import argparse

import torch
from decode_attention import median_ms

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--rows", type=int, default=2, help="rows of 3,072 tokens a step")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: checks the script, times nothing that matters")
    args = parser.parse_args()
    c = shape_config(args.shape)
    experts, top_k, width = c.num_experts, c.num_experts_per_tok, c.hidden_size
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
        a = torch.randn(int(padded[-1]), k, device=dev, dtype=torch.bfloat16)  # the padded rows' room
        stored = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * k**-0.5  # transformers'
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
        for variant, (fn, fn_args, kw) in cases.items():
            ms = median_ms(
                lambda fn=fn, fn_args=fn_args, kw=kw: fn(*fn_args, **kw), (), args.iters, dev == "cuda"
            )
            rate = flops / ms / 1e9
            print(f"{name:8s} {variant:28s} {ms:8.3f} {rate:9.1f} {rate / peak:8.1%}")


if __name__ == "__main__":
    main()
