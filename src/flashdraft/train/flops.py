"""Model FLOPs of a training step (docs/perf.md accounting) and the measured matmul rate, for MFU.

Model FLOPs count what the math needs: the target forward up to the last tapped layer, the
drafter forward + backward, the frozen lm_head forward + input gradient, fc and context K/V.
MFU is the time those FLOPs take at the matmul rates measured in the same process (never a
datasheet figure) over the time they took: with `target_fp8`, the target's converted linears at the
measured FP8 rate, everything else at the bf16 rate.
"""

from __future__ import annotations

import time

import torch

from flashdraft.model.target import layer_kinds


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10, fp8: bool = False) -> float:
    """Measured bf16 (GPU) or fp32 (CPU) matmul rate: the MFU denominator, taken in the same run. With
    `fp8`, the rate of the product `target_fp8` runs: e4m3 operands with row-wise scales through
    `torch._scaled_mm`, bf16 out."""
    if device.type == "cpu":
        n, iters = (512, 3) if fp8 else (1024, iters)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if fp8:
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as cuBLASLt needs
        scale_a, scale_b = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)

        def product():
            return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    else:

        def product():
            return a @ b

    for _ in range(3):
        product()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        product()
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def mfu(flops: dict, seconds: float, tflops: float, fp8_tflops: float | None = None, gpus: int = 1) -> float:
    """Model FLOPs utilisation of `flops` (`micro_batch_flops`'s dict, summed over what ran) done in
    `seconds` on `gpus` devices: the time they take at the measured rates over the time they took. The
    FP8 share (`flops["fp8"]`, nonzero with `target_fp8`) counts at `fp8_tflops`, the rest at `tflops`."""
    fp8 = flops.get("fp8", 0.0)
    if fp8 and not fp8_tflops:
        raise ValueError("MFU of a step with an FP8 target needs the FP8 matmul rate measured in the run")
    ideal = (flops["total"] - fp8) / (tflops * 1e12) + (fp8 / (fp8_tflops * 1e12) if fp8 else 0.0)
    return ideal / (seconds * gpus)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def layer_matmul_params(c, active: bool = True, routed: bool = True) -> int:
    """Matmul weights of one decoder layer of text config `c`: attention projections and the MLP; of a
    mixture of experts, the experts one token runs (`active`) or all of them, plus router and shared
    experts; without the routed experts and their router when not `routed` (what `target_fp8` converts:
    transformers holds both as parameters, not nn.Linear). Linear-attention and latent-attention layers
    are counted as attention layers of the same shape."""
    d, heads = c.hidden_size, c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or d // heads
    attn = d * hd * (2 * heads + 2 * kv)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0
    if not experts:
        return attn + 3 * d * c.intermediate_size
    expert = 3 * d * (getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    shared = 3 * d * (getattr(c, "shared_expert_intermediate_size", None) or 0)
    if not routed:
        return attn + shared
    return attn + (c.num_experts_per_tok if active else experts) * expert + shared + d * experts


def mean_keys(c, layer: int, seq_len: int) -> float:
    """Keys a query attends to on average in layer `layer` of a causal row of `seq_len` tokens."""
    window = getattr(c, "sliding_window", None)
    if layer_kinds(c)[layer] != "sliding_attention" or not window or window >= seq_len:
        return (seq_len + 1) / 2
    return window - window * (window - 1) / (2 * seq_len)


def step_flops(
    target_cfg,
    drafter_cfg,
    kept_layers: int,
    seq_len: int,
    positions: int,
    head_positions: int,
    document: int | None = None,
) -> dict:
    """Model FLOPs of one row (docs/perf.md): target forward to the last tapped layer, drafter
    forward + backward over `positions` query positions, lm_head forward + input gradient, and the
    per-context-token fc and context K/V (forward + backward). `head_positions`: query positions
    that go through the lm_head (slot 0 of each block does not) and, in DFlash2, the selector.
    `document`: the length of the documents packed in the row (default the whole row): attention runs
    within a document, so a query's keys are counted in its own document. A mixture-of-experts target
    counts the experts each token runs."""
    c, dc = target_cfg.get_text_config(), drafter_cfg
    span = document or seq_len
    qd = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    per_layer = 2 * layer_matmul_params(c)
    target = seq_len * sum(per_layer + 4 * mean_keys(c, i, span) * qd for i in range(kept_layers))
    draft_qd = dc.num_attention_heads * dc.head_dim
    per_pos = 6 * layer_matmul_params(dc) * dc.num_hidden_layers
    kinds = getattr(dc, "layer_types", None) or ["full_attention"] * dc.num_hidden_layers
    window = getattr(dc, "sliding_window", None) or span
    keys = [min(window, span / 2) if k == "sliding_attention" else span / 2 for k in kinds]
    per_pos += 3 * 4 * draft_qd * sum(keys)  # keys a query sees, on average: half its document, or the window
    head = head_positions * 4 * c.hidden_size * c.vocab_size
    d2 = getattr(dc, "dflash2", None)
    if d2:
        # each layer's two convolutions project a kernel from the hidden state (their taps are not
        # matmuls); the selector projects each draft position's hidden state and scores k candidates
        # and the label given the previous token
        taps = 2 * d2["conv_kernel_size"] * (c.hidden_size // d2["conv_group_size"])
        per_pos += 6 * dc.num_hidden_layers * 2 * c.hidden_size * taps
        head += head_positions * 6 * d2["selector_rank"] * (c.hidden_size + d2["selector_top_k"] + 1)
    n_taps = len(dc.target_layer_ids)
    kv = 2 * c.hidden_size * dc.num_key_value_heads * dc.head_dim
    per_ctx = 6 * (n_taps * c.hidden_size * c.hidden_size + dc.num_hidden_layers * kv)
    drafter = positions * per_pos + head + seq_len * per_ctx
    return {"target": target, "drafter": drafter, "total": target + drafter}


def micro_batch_flops(cfg, target_cfg, drafter_cfg, documents: int = 1) -> dict:
    """Model FLOPs of one micro-batch of a run (`step_flops` of a row, times its rows): every query
    position computed (num_anchors x block_size per row) as the kernels do. The trainer, the bench and
    the plan all count with this. `documents`: per row, of equal length (the bench's synthetic rows);
    a run on real data counts each row as one document, which overstates its attention FLOPs."""
    block, t = drafter_cfg.block_size, target_cfg.get_text_config()
    # distillation runs every target layer, and the target's lm_head at each label position
    kept = t.num_hidden_layers if cfg.distill else max(drafter_cfg.target_layer_ids) + 1
    row = step_flops(
        target_cfg,
        drafter_cfg,
        kept,
        cfg.data.seq_len,
        cfg.num_anchors * block,
        cfg.num_anchors * (block - 1),
        cfg.data.seq_len // documents,
    )
    if cfg.distill:
        row["target"] += cfg.num_anchors * (block - 1) * 2 * t.hidden_size * t.vocab_size
        row["total"] = row["target"] + row["drafter"]
    # target_fp8 converts the linears of every layer that runs, but not routed experts (model/fp8.py)
    row["fp8"] = cfg.data.seq_len * kept * 2 * layer_matmul_params(t, routed=False) if cfg.target_fp8 else 0
    return {k: v * cfg.data.rows_per_batch for k, v in row.items()}
