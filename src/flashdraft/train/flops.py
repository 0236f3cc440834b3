"""Model FLOPs of a training step (docs/perf.md accounting) and the measured matmul rate, for MFU.

Model FLOPs count what the math needs: the target forward up to the last tapped layer, the
drafter forward + backward, the frozen lm_head forward + input gradient, fc and context K/V.
MFU divides them by the matmul rate measured in the same process, never by a datasheet figure.
"""

from __future__ import annotations

import time

import torch
from transformers import Qwen3Config


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


def _layer_matmul_params(c: Qwen3Config, intermediate: int | None = None) -> int:
    d, hd = c.hidden_size, c.head_dim
    attn = d * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    return attn + 3 * d * (intermediate or c.intermediate_size)


def step_flops(
    target_cfg: Qwen3Config, drafter_cfg, kept_layers: int, seq_len: int, positions: int, head_positions: int
) -> dict:
    """Model FLOPs of one row (docs/perf.md): target forward to the last tapped layer, drafter
    forward + backward over `positions` query positions, lm_head forward + input gradient, and the
    per-context-token fc and context K/V (forward + backward). `head_positions`: query positions
    that go through the lm_head (slot 0 of each block does not)."""
    c, dc = target_cfg, drafter_cfg
    qd = c.num_attention_heads * c.head_dim
    target = seq_len * kept_layers * (2 * _layer_matmul_params(c) + 4 * (seq_len / 2) * qd)
    per_pos = 6 * _layer_matmul_params(dc) * dc.num_hidden_layers
    per_pos += 3 * 4 * qd * (seq_len / 2) * dc.num_hidden_layers
    head = head_positions * 4 * c.hidden_size * c.vocab_size
    n_taps = len(dc.target_layer_ids)
    kv = 2 * c.hidden_size * dc.num_key_value_heads * dc.head_dim
    per_ctx = 6 * (n_taps * c.hidden_size * c.hidden_size + dc.num_hidden_layers * kv)
    drafter = positions * per_pos + head + seq_len * per_ctx
    return {"target": target, "drafter": drafter, "total": target + drafter}
