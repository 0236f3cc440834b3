"""A tiny Gemma 3 text target as its checkpoints come: a Gemma3ForCausalLM shaped like Gemma 3 270M in
miniature (4 query heads, 1 KV head of 256, every sixth layer full attention, tied embedding) and a
tokenizer of Gemma's kind, built here so nothing is downloaded.

Gemma's tokenizer is a SentencePiece BPE with byte fallback: transformers' GemmaTokenizer (tokenizer.json)
and the SentencePiece model (tokenizer.model) that llama.cpp's converter reads. The vocabulary is Gemma's
layout in small: <pad> <eos> <bos> <unk> <mask>, the 256 byte pieces, then pieces learned by a BPE trainer
on a few lines of code and prose (within words, as SentencePiece splits at whitespace). tokenizer.model is
written with transformers' copy of the SentencePiece protobuf schema: each piece with its type and, for
learned pieces, a score that falls with the merge that made it, as SentencePiece scores BPE pieces.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.convert_slow_tokenizer import import_protobuf
from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

from flashdraft.export.gguf_target import write_gguf_target

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.path.join('src', 'main.py'))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i * i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "A drafter proposes a block of tokens and the target checks them all at once.",
]
MERGES = 120
LAYERS = 7  # layers 0-4 and 6 sliding, 5 full: both kinds, and a sliding layer after a full one
WINDOW = 8
HIDDEN = 64
# SentencePiece piece types (sentencepiece_model.proto)
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


def _learned_pieces() -> tuple[list[str], list[tuple[str, str]]]:
    """(the alphabet then each merge's piece, in merge order; the merges)."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    bpe.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=10_000, show_progress=False))
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) for m in state["merges"]][:MERGES]
    alphabet = sorted((t for t in state["vocab"] if len(t) == 1), key=state["vocab"].get)
    return alphabet + ["".join(m) for m in merges], merges


def build_tokenizer() -> GemmaTokenizer:
    pieces, merges = _learned_pieces()
    vocab = {t: i for i, t in enumerate(SPECIALS + BYTES + pieces)}
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)


def write_sentencepiece_model(tokenizer: GemmaTokenizer, path: Path) -> None:
    """tokenizer.model for `tokenizer`'s vocabulary: the pieces by id, typed and scored."""
    proto = import_protobuf().ModelProto()
    learned = len(SPECIALS) + len(BYTES)
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i < len(SPECIALS):
            kind = _UNKNOWN if piece == "<unk>" else _CONTROL
        else:
            kind = _BYTE if i < learned else _NORMAL
        proto.pieces.add(piece=piece, score=0.0 if i < learned else float(learned - i), type=kind)
    proto.trainer_spec.model_type = proto.trainer_spec.BPE
    proto.trainer_spec.byte_fallback = True
    path.write_bytes(proto.SerializeToString())


def build_model(tokenizer: GemmaTokenizer, seed: int = 0):
    """A random Gemma3ForCausalLM over `tokenizer` with random norm weights (Gemma's norms scale by
    1 + weight, so zeros, the initial value, would hide a missing + 1) and a peaked tied embedding."""
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=WINDOW, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
    return model.eval()


def write_target(root: Path, dtype: str = "f32"):
    """(model, tokenizer, its HF directory, the .gguf written from it by flashdraft's conversion)."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    hf = root / "gemma3-tiny"
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    write_sentencepiece_model(tokenizer, hf / "tokenizer.model")
    return model, tokenizer, hf, write_gguf_target(hf, root / f"gemma3-tiny.{dtype}.gguf", dtype)
