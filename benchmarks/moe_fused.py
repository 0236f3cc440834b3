"""A fused mixture-of-experts forward in Triton against the target forward's own experts, measured before
the target uses it.

flashdraft's `gather_sum` experts (flashdraft.model.experts) run, per layer: a gather of each token's row
once per chosen expert (fused with the norm before it), the gate/up grouped GEMM, SiLU times up, the
down grouped GEMM, and the weighted sum of each token's top-k rows. On one H100 at two rows of
qwen3-30b-a3b the GEMMs took 44.7 ms of the 95.0 ms target forward and the three pointwise passes
12.9 ms (docs/results.md). Here:

- gate/up: one program per block of BLOCK_M rows of one expert and BLOCK_N columns of its hidden width
  loads each row straight from the token's hidden state (no gathered copy), computes gate and up, and
  writes silu(gate) * up;
- down: the same blocks, each row's output times its routing weight, written to its (token, slot) row;
- the sum over each token's top-k slots: contiguous rows, one pass.

The rows are sorted by expert and each expert's run padded to BLOCK_M on the host side in torch (the
layout fused-MoE inference kernels use). Compared, for its output and its time, with what the target
forward runs: flashdraft's gather_sum experts (torch._grouped_mm) on transformers' Qwen3-MoE experts
module, compiled as the target's layers are. Times are medians of --iters CUDA-event timings after
warm-up. GPU only; `TRITON_INTERPRET=1 ... --check-only --tiny` checks the kernels on a CPU, in fp32
(the interpreter's bf16 products are wrong).

    python benchmarks/moe_fused.py [--shape qwen3-30b-a3b] [--rows 2] [--iters 20]
"""

import argparse

import torch
import triton
import triton.language as tl
from decode_attention import median_ms

from flashdraft.bench import shape_config
from flashdraft.model.experts import gather_sum_experts


@triton.jit
def _block_rows(rows, block_expert, pairs, BLOCK_M: tl.constexpr):
    """This program's block: its expert (-1: an unused block), its padded positions, the pair at each
    and which of them hold one."""
    block = tl.program_id(0)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows + offs_m)
    return tl.load(block_expert + block), offs_m, pair, pair < pairs


@triton.jit
def _gate_up(
    x,
    w13,
    out,
    rows,
    block_expert,
    pairs,
    width: tl.constexpr,
    inner: tl.constexpr,
    k_slots: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, inner + n]) for the block's rows r, their token
    t = pair // k_slots and the block's expert e."""
    expert, offs_m, pair, live = _block_rows(rows, block_expert, pairs, BLOCK_M)
    if expert < 0:
        return
    token = tl.where(live, pair // k_slots, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w13 + expert.to(tl.int64) * 2 * inner * width
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, width, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(
            x + token[:, None] * width + kk[None, :], mask=live[:, None] & (kk[None, :] < width), other=0.0
        )
        wmask = (offs_n[None, :] < inner) & (kk[:, None] < width)
        wg = tl.load(w_base + offs_n[None, :] * width + kk[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (inner + offs_n[None, :]) * width + kk[:, None], mask=wmask, other=0.0)
        gate = tl.dot(a, wg, gate)
        up = tl.dot(a, wu, up)
    h = gate * tl.sigmoid(gate) * up
    dst = out + offs_m[:, None].to(tl.int64) * inner + offs_n[None, :]
    tl.store(dst, h.to(out.dtype.element_ty), mask=live[:, None] & (offs_n[None, :] < inner))


@triton.jit
def _down(
    h,
    w2,
    out,
    rows,
    block_expert,
    weights,
    pairs,
    width: tl.constexpr,
    inner: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, n] = weight[pair] * (h[r] . w2[e, n]) for the block's rows r and expert e."""
    expert, offs_m, pair, live = _block_rows(rows, block_expert, pairs, BLOCK_M)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w2 + expert.to(tl.int64) * width * inner
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(
            h + offs_m[:, None].to(tl.int64) * inner + kk[None, :],
            mask=live[:, None] & (kk[None, :] < inner),
            other=0.0,
        )
        b = tl.load(
            w_base + offs_n[None, :] * inner + kk[:, None],
            mask=(offs_n[None, :] < width) & (kk[:, None] < inner),
            other=0.0,
        )
        acc = tl.dot(a, b, acc)
    scale = tl.load(weights + tl.where(live, pair, 0), mask=live, other=0.0)
    acc = acc * scale[:, None]
    dst = out + tl.where(live, pair, 0).to(tl.int64)[:, None] * width + offs_n[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=live[:, None] & (offs_n[None, :] < width))


def padded_layout(top_k_index: torch.Tensor, experts: int, block_m: int):
    """(rows [capacity] the pair index at each padded position, pairs (an index past every pair) at the
    padding; block_expert [capacity // block_m] each block's expert, -1 past the last used block). Each
    expert's pairs are contiguous, in their order of appearance, its run padded to block_m. The capacity
    is fixed by the shapes alone: pairs + experts x (block_m - 1), rounded up to block_m. No host sync
    (no op whose output size depends on the routing), as the target forward needs."""
    flat = top_k_index.reshape(-1)
    pairs = flat.numel()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    ends = torch.cumsum(padded, 0)
    capacity = (pairs + experts * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_expert = flat[order]
    dest = (
        ends[sorted_expert]
        - padded[sorted_expert]
        + torch.arange(pairs, device=flat.device)
        - start[sorted_expert]
    )
    rows = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    rows[dest] = order.int()
    # a block's expert: the first whose padded run ends after the block's start
    starts = torch.arange(capacity // block_m, device=flat.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    return rows, torch.where(block_expert < experts, block_expert, -1).int()


def fused_moe(x, top_k_index, top_k_weights, w13, w2, block_m=64, block_n=128, block_k=64, warps=8, stages=3):
    """x [tokens, width]; top_k_index, top_k_weights [tokens, k]; w13 [experts, 2 inner, width] (gate rows
    first), w2 [experts, width, inner] (transformers' layouts) -> [tokens, width]."""
    tokens, k = top_k_index.shape
    experts, width, inner = w2.shape
    rows, block_expert = padded_layout(top_k_index, experts, block_m)
    pairs = tokens * k
    h = torch.empty(rows.numel(), inner, device=x.device, dtype=x.dtype)
    grid = (block_expert.numel(), triton.cdiv(inner, block_n))
    opts = {"num_warps": warps, "num_stages": stages}
    _gate_up[grid](x, w13, h, rows, block_expert, pairs, width, inner, k, block_m, block_n, block_k, **opts)
    out = torch.empty(pairs, width, device=x.device, dtype=x.dtype)
    weights = top_k_weights.float().reshape(-1).contiguous()
    grid = (block_expert.numel(), triton.cdiv(width, block_n))
    _down[grid](
        h, w2, out, rows, block_expert, weights, pairs, width, inner, block_m, block_n, block_k, **opts
    )
    return out.view(tokens, k, width).sum(1, dtype=torch.float32).to(x.dtype)


def reference_experts(config, w13: torch.Tensor, w2: torch.Tensor):
    """The target forward's experts: transformers' Qwen3-MoE experts module holding w13 and w2, run by
    flashdraft's gather_sum (called as (module, hidden_states, top_k_index, top_k_weights))."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    with torch.device("meta"):
        module = Qwen3MoeExperts(config)
    module.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    module.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return module


def inputs(tokens, width, inner, experts, k, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, width, generator=g).to(device, dtype)
    router = torch.randn(width, experts, generator=g).to(device, dtype) * width**-0.5
    probs = (x @ router).float().softmax(-1)
    top_w, top_i = probs.topk(k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    w13 = (torch.randn(experts, 2 * inner, width, generator=g) * width**-0.5).to(device, dtype)
    w2 = (torch.randn(experts, width, inner, generator=g) * inner**-0.5).to(device, dtype)
    return x, top_i, top_w, w13, w2


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--rows", type=int, default=2, help="rows of 3,072 tokens")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--tiny", action="store_true", help="a small shape of the same kind (with --check-only)"
    )
    parser.add_argument("--check-only", action="store_true", help="compare the outputs, time nothing")
    args = parser.parse_args()
    device = "cpu" if args.check_only and not torch.cuda.is_available() else "cuda"
    if args.tiny:
        from transformers import Qwen3MoeConfig

        c = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2)
        tokens, blocks = 40, {"block_m": 16, "block_n": 16, "block_k": 16}
    else:
        c, tokens, blocks = shape_config(args.shape), args.rows * 3072, {}
    width, inner, experts, k = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok
    # Triton's interpreter multiplies bf16 wrongly: a CPU check runs the kernels in fp32
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, top_i, top_w, w13, w2 = inputs(tokens, width, inner, experts, k, device, dtype)
    module = reference_experts(c, w13, w2)
    ref = gather_sum_experts(module, x, top_i, top_w)
    got = fused_moe(x, top_i, top_w, w13, w2, **blocks)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    print(
        f"{tokens} tokens, top-{k} of {experts} experts of {inner}, width {width}: relative error {err:.2e}"
    )
    assert err < 2e-2, err
    if args.check_only:
        return
    compiled_ref = torch.compile(gather_sum_experts, dynamic=False)
    t_ref = median_ms(compiled_ref, (module, x, top_i, top_w), args.iters)
    print(f"gather_sum experts (grouped_mm, compiled): {t_ref:.3f} ms a layer")
    flops = 2 * tokens * k * width * 3 * inner
    # gate/up holds two fp32 accumulators of BLOCK_M x BLOCK_N: 128 registers a thread at 64 x 128 over
    # four warps, so the larger tiles take eight
    for bm, bn, bk, warps, stages in [
        (64, 128, 64, 8, 3),
        (128, 128, 64, 8, 3),
        (64, 64, 64, 4, 4),
        (128, 64, 64, 4, 3),
        (128, 64, 64, 8, 4),
    ]:
        cfg = {"block_m": bm, "block_n": bn, "block_k": bk, "warps": warps, "stages": stages}
        t = median_ms(lambda cfg=cfg: fused_moe(x, top_i, top_w, w13, w2, **cfg), (), args.iters)
        print(f"fused {cfg}: {t:.3f} ms a layer, {flops / t / 1e9:.0f} TFLOP/s of expert FLOPs")


if __name__ == "__main__":
    main()
