"""Shared tiny fixtures: a tokenizer and a Qwen3 target built locally (nothing downloaded)."""

import pytest
import torch

from flashdraft.data.packing import save_token_dataset
from flashdraft.demo.tiny import build_tiny_target, build_tokenizer, save_target, stdlib_files
from helpers import random_docs


@pytest.fixture(scope="session")
def tiny_tokenizer():
    texts = [p.read_text(errors="replace") for p in stdlib_files(limit=30)]
    return build_tokenizer(texts, vocab_size=384)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer):
    """An HF model directory (random tiny Qwen3, 6 layers, hidden 64) with its tokenizer."""
    torch.manual_seed(0)
    model = build_tiny_target(tiny_tokenizer)
    return save_target(model, tiny_tokenizer, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def token_data_dir(tmp_path_factory):
    """A token dataset of 12 random documents (70-120 tokens, the first 10 of each out of the loss), as
    `flashdraft data prepare` writes one."""
    path = tmp_path_factory.mktemp("data")
    save_token_dataset(random_docs([70, 90, 120, 60, 100, 80] * 2, seed=5, prompt_len=10), path)
    return path
