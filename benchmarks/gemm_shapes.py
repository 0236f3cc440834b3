"""One drafter layer's matmuls as the training step runs them, against fused projections and weight
gradients written in fp32: the most each change could save, measured before either is built.

For a bench shape's drafter (its width, heads and MLP; rows x anchors x block queries; rows x seq_len
context rows), each linear of a layer is timed as autocast runs it from an fp32 master weight:

- forward: the weight cast to bf16, then the bf16 matmul (the cast alone in its own column);
- input gradient: a bf16 matmul;
- weight gradient: a bf16 matmul, then a cast to fp32 (autocast's backward of the weight's cast);
- weight gradient in fp32: the matmul writes fp32 itself (`torch.mm(..., out_dtype=torch.float32)`).

Then the same for the block's q/k/v as one matmul, the context's k/v as one and gate/up as one. Each
figure is the median of --iters CUDA-event timings after warm-up. The fused kernels that inductor makes
of the casts in the compiled step may already save part of what the table offers. GPU only.

    python benchmarks/gemm_shapes.py --shape qwen3-8b [--rows 2] [--iters 20]
"""

import argparse

import torch
from decode_attention import median_ms

from flashdraft.bench import DEFAULT_ROWS, shape_config
from flashdraft.model.drafter import drafter_config
from flashdraft.train.flops import matmul_tflops

FUSED = {"q/k/v": ("q", "k", "v"), "context k/v": ("context k", "context v"), "gate/up": ("gate", "up")}


def linears(shape: str, rows: int, seq_len: int, anchors: int, block: int) -> dict[str, tuple[int, int, int]]:
    """Each linear of one drafter layer, and the fusion of the tapped features: name -> (M, K, N)."""
    target = shape_config(shape)
    taps = min(5, target.num_hidden_layers - 3)
    c = drafter_config(target, 5, None, taps, block, 0)
    d, f = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    queries, context = rows * anchors * block, rows * seq_len
    return {
        "q": (queries, d, q),
        "k": (queries, d, kv),
        "v": (queries, d, kv),
        "o": (queries, q, d),
        "context k": (context, d, kv),
        "context v": (context, d, kv),
        "gate": (queries, d, f),
        "up": (queries, d, f),
        "down": (queries, f, d),
        "fc (once a step)": (context, taps * d, d),
    }


def time_linear(m: int, k: int, n: int, iters: int) -> dict[str, float]:
    """The table's five timings of one linear [m, k] x [k, n], in ms."""
    dev = torch.device("cuda")
    master = torch.randn(n, k, device=dev) * 0.02
    weight = master.bfloat16()
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    return {
        "cast": median_ms(lambda: master.to(torch.bfloat16), (), iters),
        "forward": median_ms(lambda: x @ master.to(torch.bfloat16).t(), (), iters),
        "input grad": median_ms(lambda: dy @ weight, (), iters),
        "weight grad": median_ms(lambda: (dy.t() @ x).float(), (), iters),
        "weight grad fp32": median_ms(lambda: torch.mm(dy.t(), x, out_dtype=torch.float32), (), iters),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", type=int, default=None, help="rows a micro-batch (default: the bench's)")
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_shapes.py times CUDA matmuls: no GPU here")
    rows = args.rows or DEFAULT_ROWS.get(args.shape, 1)
    shapes = linears(args.shape, rows, args.seq_len, args.anchors, args.block_size)
    for name, parts in FUSED.items():
        m, k, _ = shapes[parts[0]]
        shapes[name] = (m, k, sum(shapes[p][2] for p in parts))
    peak = matmul_tflops(torch.device("cuda"))
    print(f"{args.shape}, {rows} rows; matmul rate {peak:.0f} TFLOP/s (same run); ms, median of {args.iters}")
    cols = ("cast", "forward", "input grad", "weight grad", "weight grad fp32")
    print(f"{'linear':<18}{'M x K x N':>22}" + "".join(f"{c:>18}" for c in cols) + f"{'fwd TFLOP/s':>13}")
    times = {}
    for name, (m, k, n) in shapes.items():
        t = times[name] = time_linear(m, k, n, args.iters)
        rate = 2 * m * k * n / ((t["forward"] - t["cast"]) * 1e9)
        row = f"{name:<18}{f'{m} x {k} x {n}':>22}" + "".join(f"{t[c]:>18.3f}" for c in cols)
        print(row + f"{rate:>13.0f}")
    per_layer = [n for n in shapes if n not in FUSED and not n.startswith("fc")]
    step = sum(times[n][c] for n in per_layer for c in ("forward", "input grad", "weight grad"))
    print(f"\none layer's linears, forward and backward: {step:.2f} ms")
    for name, parts in FUSED.items():
        apart = sum(times[p][c] for p in parts for c in ("forward", "input grad", "weight grad"))
        fused = sum(times[name][c] for c in ("forward", "input grad", "weight grad"))
        print(f"fused {name}: {apart:.3f} -> {fused:.3f} ms a layer")
    fp32 = sum(times[n]["weight grad"] - times[n]["weight grad fp32"] for n in per_layer)
    casts = sum(times[n]["cast"] for n in per_layer)
    print(f"weight gradients written in fp32: {fp32:.3f} ms a layer less")
    print(f"the weights' casts to bf16 (bf16 weights kept beside the masters): {casts:.3f} ms a layer less")


if __name__ == "__main__":
    main()
