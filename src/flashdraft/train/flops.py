"""Model FLOPs of a training step (docs/perf.md accounting) and the measured matmul rate, for MFU.

Model FLOPs count what the math needs: the target forward up to the last tapped layer, the
drafter forward + backward, the frozen lm_head forward + input gradient, fc and context K/V.
MFU divides them by the matmul rate measured in the same process, never by a datasheet figure.
"""

from __future__ import annotations

import time

import torch

from flashdraft.model.target import layer_kinds


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """Measured bf16 (GPU) or fp32 (CPU) matmul rate: the MFU denominator, taken in the same run."""
    if device.type == "cpu":
        n, dtype = 1024, torch.float32
    else:
        dtype = torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def layer_matmul_params(c, active: bool = True) -> int:
    """Matmul weights of one decoder layer of text config `c`: attention projections and the MLP; of a
    mixture of experts, the experts one token runs (`active`) or all of them, plus router and shared
    experts. Linear-attention layers are counted as attention layers of the same shape."""
    d, heads = c.hidden_size, c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or d // heads
    attn = d * hd * (2 * heads + 2 * kv)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0
    if not experts:
        return attn + 3 * d * c.intermediate_size
    expert = 3 * d * (getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    shared = 3 * d * (getattr(c, "shared_expert_intermediate_size", None) or 0)
    return attn + (c.num_experts_per_tok if active else experts) * expert + shared + d * experts


def mean_keys(c, layer: int, seq_len: int) -> float:
    """Keys a query attends to on average in layer `layer` of a causal row of `seq_len` tokens."""
    window = getattr(c, "sliding_window", None)
    if layer_kinds(c)[layer] != "sliding_attention" or not window or window >= seq_len:
        return (seq_len + 1) / 2
    return window - window * (window - 1) / (2 * seq_len)


def step_flops(
    target_cfg, drafter_cfg, kept_layers: int, seq_len: int, positions: int, head_positions: int
) -> dict:
    """Model FLOPs of one row (docs/perf.md): target forward to the last tapped layer, drafter
    forward + backward over `positions` query positions, lm_head forward + input gradient, and the
    per-context-token fc and context K/V (forward + backward). `head_positions`: query positions
    that go through the lm_head (slot 0 of each block does not). A mixture-of-experts target counts
    the experts each token runs."""
    c, dc = target_cfg.get_text_config(), drafter_cfg
    qd = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    per_layer = 2 * layer_matmul_params(c)
    target = seq_len * sum(per_layer + 4 * mean_keys(c, i, seq_len) * qd for i in range(kept_layers))
    draft_qd = dc.num_attention_heads * dc.head_dim
    per_pos = 6 * layer_matmul_params(dc) * dc.num_hidden_layers
    kinds = getattr(dc, "layer_types", None) or ["full_attention"] * dc.num_hidden_layers
    window = getattr(dc, "sliding_window", None) or seq_len
    keys = [min(window, seq_len / 2) if k == "sliding_attention" else seq_len / 2 for k in kinds]
    per_pos += 3 * 4 * draft_qd * sum(keys)  # keys a query sees, on average: half the row, or the window
    head = head_positions * 4 * c.hidden_size * c.vocab_size
    n_taps = len(dc.target_layer_ids)
    kv = 2 * c.hidden_size * dc.num_key_value_heads * dc.head_dim
    per_ctx = 6 * (n_taps * c.hidden_size * c.hidden_size + dc.num_hidden_layers * kv)
    drafter = positions * per_pos + head + seq_len * per_ctx
    return {"target": target, "drafter": drafter, "total": target + drafter}


def micro_batch_flops(cfg, target_cfg, drafter_cfg) -> dict:
    """Model FLOPs of one micro-batch of a run (`step_flops` of a row, times its rows): every query
    position computed (num_anchors x block_size per row) as the kernels do. The trainer, the bench and
    the plan all count with this."""
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
    )
    if cfg.distill:
        row["target"] += cfg.num_anchors * (block - 1) * 2 * t.hidden_size * t.vocab_size
        row["total"] = row["target"] + row["drafter"]
    return {k: v * cfg.data.rows_per_batch for k, v in row.items()}
