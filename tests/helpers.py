"""Small builders shared by the tests: a tiny target, a drafter for it, and packed batches."""

from __future__ import annotations

import os

import torch
from transformers import Qwen3ForCausalLM

from flashdraft.data.packing import PackedBatch, collate_rows
from flashdraft.demo.tiny import tiny_qwen3_config
from flashdraft.model.drafter import DFlashDrafter, drafter_config
from flashdraft.model.target import Target
from flashdraft.train.build import init_drafter_

VOCAB = 96
MASK_ID = VOCAB - 1
BLOCK = 8
GAMMA = 4.0


def tiny_target(seed: int = 0, layers: int = 6) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(VOCAB, hidden=32, layers=layers, heads=4, kv_heads=2)).eval()


def tiny_drafter(model, num_layers: int = 2, num_taps: int = 2, seed: int = 0, block: int = BLOCK):
    cfg = drafter_config(model.config, num_layers, None, num_taps, block, MASK_ID)
    drafter = DFlashDrafter(cfg)
    init_drafter_(drafter, std=0.1, seed=seed)
    return drafter.eval()


def target_and_drafter(seed: int = 0):
    model = tiny_target(seed)
    drafter = tiny_drafter(model, seed=seed)
    return Target(model, drafter.target_layer_ids), drafter


def random_docs(lengths: list[int], seed: int = 0, prompt_len: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
        docs.append({"input_ids": ids, "loss_mask": [0] * prompt_len + [1] * (n - prompt_len)})
    return docs


def packed_batch(rows: list[list[int]], seq_len: int, seed: int = 0) -> PackedBatch:
    """rows: document lengths per row, e.g. [[20, 30], [50]]."""
    docs = [random_docs(row, seed=seed + k) for k, row in enumerate(rows)]
    return collate_rows(docs, seq_len, pad_token_id=0)


def signal_after_step(trainer, at: int, signum: int) -> None:
    """Make `trainer` send this process `signum` once its step `at` is done: a Ctrl-C or a scheduler's
    SIGTERM in the middle of a run."""
    step = trainer.train_step

    def step_then_signal(*args, **kwargs):
        stats = step(*args, **kwargs)
        if trainer.step == at:
            os.kill(os.getpid(), signum)
        return stats

    trainer.train_step = step_then_signal
