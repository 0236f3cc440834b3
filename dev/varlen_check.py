"""Checks, on a GPU, two things about torch's variable-length flash kernel that flashdraft's varlen target
attention (src/flashdraft/model/varlen_attention.py) would use if they hold on the installed torch:

1. grouped heads: torch 2.11's `varlen_attn` has no `enable_gqa`. Its custom op calls aten's flash kernel,
   which may take fewer key/value heads as they are. Compared: the output with unrepeated heads against
   the repeated heads' (forward and gradients), and the time of each. On an H200 (2026-12-05): equal
   outputs, gradients within 0.0005, 0.395 against 0.574 ms; the attention passes them unrepeated.
2. inside a compiled graph: the attention runs in each compiled target layer's graph. Counted: the
   graph breaks and recompiles of a compiled call over batches cut into different documents, with the
   cumulative lengths marked dynamic and the longest document fixed at the row's length, as the
   attention calls it. On an H200 (2026-12-05): one graph for 4 batches, no graph break.

    PYTHONPATH=src python3 dev/varlen_check.py
"""

import statistics
import time

import torch
from torch.nn.attention.varlen import varlen_attn

HEADS, KV_HEADS, DIM, ROWS, LENGTH = 32, 4, 128, 4, 3072


def cumulative(documents: int) -> torch.Tensor:
    cuts = torch.linspace(0, LENGTH, documents + 1).round().int()[:-1]
    starts = torch.cat([cuts + r * LENGTH for r in range(ROWS)] + [torch.tensor([ROWS * LENGTH])])
    return starts.int().cuda()


def timed(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def grouped_heads() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)

    def random(heads):
        shape = (ROWS * LENGTH, heads, DIM)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v = random(HEADS), random(KV_HEADS), random(KV_HEADS)
    cu, groups = cumulative(6), HEADS // KV_HEADS

    def repeated():
        kr, vr = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        return varlen_attn(q, kr, vr, cu, cu, LENGTH, LENGTH, window_size=(-1, 0))

    def unrepeated():
        return varlen_attn(q, k, v, cu, cu, LENGTH, LENGTH, window_size=(-1, 0))

    want = repeated()
    try:
        got = unrepeated()
    except Exception as e:  # noqa: BLE001 - the finding is that it refuses
        print(f"grouped heads: refused ({type(e).__name__}: {str(e)[:200]})")
        return
    print(f"grouped heads: output max difference {(want - got).abs().max().item():.3g}")
    try:
        grads = [torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in (want, got)]
    except Exception as e:  # noqa: BLE001
        print(f"  backward: refused ({type(e).__name__}: {str(e)[:200]})")
    else:
        worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(*grads, strict=True))
        print(f"  gradients: max difference {worst:.3g}")
    with torch.no_grad():
        print(f"  forward: repeated {timed(repeated):.3f} ms, unrepeated {timed(unrepeated):.3f} ms")


def in_a_graph() -> None:
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()

    @torch.compile(dynamic=False)
    def layer(x, cu):
        q = x.view(-1, HEADS, DIM) * 2
        kv = q[:, :KV_HEADS].repeat_interleave(HEADS // KV_HEADS, dim=1)
        return varlen_attn(q, kv, kv, cu, cu, LENGTH, LENGTH, window_size=(-1, 0)).sum(-1)

    x = torch.randn(ROWS * LENGTH, HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    for documents in (6, 5, 9, 6):
        cu = cumulative(documents)
        torch._dynamo.mark_dynamic(cu, 0)
        with torch.no_grad():
            layer(x, cu)
    frames = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    print(f"in a graph: {frames} graphs for 4 batches of 6, 5, 9, 6 documents, {breaks} graph breaks")


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    grouped_heads()
    in_a_graph()
