"""A Gemma 3 text model (Gemma3ForCausalLM) in the GGUF layout llama.cpp's converter writes.

Hand-written for the reason flashdraft.export.gguf_target is: llama.cpp's converter is not an installable
package. This module follows build 11434's `conversion/gemma.py` (`Gemma3Model`) and `conversion/base.py`
(`TextModel.set_gguf_parameters`, `_set_vocab_sentencepiece`, `_create_vocab_sentencepiece`,
`does_token_look_special`), and what the graph in `src/models/gemma3.cpp` assumes:

- the vocabulary comes from `tokenizer.model` (SentencePiece): `tokenizer.ggml.model` "llama", pre
  "default", every piece with its score and type (unknown, control, unused, byte, else normal), the
  tokens of `added_tokens.json` and of tokenizer_config.json's `added_tokens_decoder` over them (control
  when special or special-looking, else user-defined with "▁" read as a space; score -1000), padded with
  `[PADi]` to the config's `vocab_size`; gguf's SpecialVocab (the converter's) adds the special ids,
  add_bos/add_eos and the chat template; `add_space_prefix` false. The converter reads the pieces with
  the sentencepiece package; this reads the same fields of the protobuf with transformers' copy of its
  schema, so no sentencepiece is needed;
- norm weights stored plus 1 (Gemma3RMSNorm scales by 1 + weight, llama.cpp's RMS norm by the weight);
  the embedding stored as it is (the graph multiplies it by sqrt(hidden_size));
- `rope.freq_base` from the full-attention layers' RoPE, `rope.freq_base_swa` from the sliding ones',
  linear scaling of the full-attention layers; `attention.sliding_window`; `final_logit_softcapping`.

What llama.cpp would run differently from transformers is refused, naming why: the converter writes no
sliding-window pattern and the graph then takes every sixth layer as full attention (`load_swa_pattern(ml,
6)`), so other `layer_types` are refused; the graph scales queries by 1/sqrt(head_dim) (1/sqrt(hidden /
heads) at 62 layers), so another `query_pre_attn_scalar` is; so are attention-logit softcapping (the
converter asserts there is none), bidirectional attention (EmbeddingGemma), an activation other than
gelu_pytorch_tanh, RoPE other than default or linear on full-attention layers and default on sliding
ones, and a directory without tokenizer.model (the converter would take the GPT-2 BPE path instead).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch

from flashdraft.export.gguf_drafter import _add_rope

ARCH = gguf.MODEL_ARCH.GEMMA3
_SWA_PERIOD = 6  # src/models/gemma3.cpp: load_swa_pattern(ml, 6)
_27B_LAYERS = 62  # the one size whose queries llama.cpp scales by 1/sqrt(hidden / heads)
_SP_TYPES = {  # sentencepiece_model.proto's ModelProto.SentencePiece.Type -> the type the converter writes
    2: gguf.TokenType.UNKNOWN,
    3: gguf.TokenType.CONTROL,
    5: gguf.TokenType.UNUSED,
    6: gguf.TokenType.BYTE,
}


def layer_pattern(num_layers: int) -> list[str]:
    """The layer kinds llama.cpp's Gemma 3 graph runs: every sixth layer full attention."""
    return ["sliding_attention" if (i + 1) % _SWA_PERIOD else "full_attention" for i in range(num_layers)]


def model_problems(cfg: dict) -> list[str]:
    """What in a Gemma 3 config llama.cpp would run differently from transformers."""
    problems = []
    layers = cfg["num_hidden_layers"]
    if (cfg.get("layer_types") or layer_pattern(layers)) != layer_pattern(layers):
        problems.append(
            f"layer_types {cfg['layer_types']}: llama.cpp's gemma3 graph makes every sixth layer full "
            "attention (the converter writes no pattern)"
        )
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == _27B_LAYERS else cfg["head_dim"]
    if cfg.get("query_pre_attn_scalar") != head_dim:
        problems.append(
            f"query_pre_attn_scalar {cfg.get('query_pre_attn_scalar')}: llama.cpp scales queries by "
            f"1/sqrt({head_dim})"
        )
    if cfg.get("attn_logit_softcapping") is not None:
        problems.append("attn_logit_softcapping: llama.cpp's gemma3 graph caps no attention logits")
    if cfg.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention: llama.cpp's gemma3 graph is causal")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {cfg['hidden_activation']!r}: llama.cpp's graph runs GELU (tanh)")
    rope = cfg.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if full.get("rope_type", "default") not in ("default", "linear"):
        problems.append(f"full-attention rope_type {full['rope_type']!r}: llama.cpp reads default, linear")
    if sliding.get("rope_type", "default") != "default":
        problems.append(f"sliding-attention rope_type {sliding['rope_type']!r}: llama.cpp scales none there")
    return problems


def add_shape(writer: gguf.GGUFWriter, cfg: dict) -> None:
    """Gemma3Model.set_gguf_parameters's keys beyond the shape every architecture has: RoPE per layer kind,
    the window, the final softcap."""
    rope = cfg["rope_parameters"]
    _add_rope(writer, rope["full_attention"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_sliding_window(cfg["sliding_window"])
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def converted(name: str, w: torch.Tensor) -> torch.Tensor:
    """A tensor as the converter stores it: norms plus 1 (Gemma3Model.modify_tensors)."""
    return w + 1.0 if name.endswith("norm.weight") else w


def _looks_special(token: str) -> bool:
    """`does_token_look_special` of conversion/base.py."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


class SentencePieceVocab:
    """tokenizer.model's pieces, scores and types, as `_create_vocab_sentencepiece` makes them."""

    def __init__(self, src: Path, vocab_size: int):
        from transformers.convert_slow_tokenizer import import_protobuf

        self.problems: list[str] = []
        proto = import_protobuf().ModelProto()
        proto.ParseFromString((src / "tokenizer.model").read_bytes())
        if len(proto.pieces) > vocab_size:
            self.problems.append(
                f"tokenizer.model has {len(proto.pieces)} pieces, the model's vocabulary {vocab_size} rows"
            )
        self.tokens = [f"[PAD{i}]" for i in range(vocab_size)]
        self.scores = [-10000.0] * vocab_size
        self.types = [gguf.TokenType.UNUSED] * vocab_size
        for i, piece in enumerate(proto.pieces[:vocab_size]):
            self.tokens[i], self.scores[i] = piece.piece, piece.score
            self.types[i] = _SP_TYPES.get(piece.type, gguf.TokenType.NORMAL)
        added = src / "added_tokens.json"
        for token, i in (json.loads(added.read_text()) if added.is_file() else {}).items():
            self._set(i, token, gguf.TokenType.USER_DEFINED)
        config = src / "tokenizer_config.json"
        decoder = json.loads(config.read_text()).get("added_tokens_decoder", {}) if config.is_file() else {}
        for i, data in decoder.items():
            token = data["content"]
            if data.get("special") or _looks_special(token):
                self._set(int(i), token, gguf.TokenType.CONTROL)
            else:
                self._set(int(i), token.replace("\u2581", " "), gguf.TokenType.USER_DEFINED)

    def _set(self, i: int, token: str, kind: gguf.TokenType) -> None:
        if i >= len(self.tokens):
            self.problems.append(f"added token {token!r}: id {i} is past the vocabulary's {len(self.tokens)}")
            return
        self.tokens[i], self.scores[i], self.types[i] = token, -1000.0, kind

    def add_to(self, writer: gguf.GGUFWriter, src: Path) -> None:
        """`Gemma3Model.set_vocab` with a tokenizer.model."""
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(self.tokens)
        writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        gguf.SpecialVocab(src, n_vocab=len(self.tokens)).add_to_gguf(writer, quiet=True)
        writer.add_add_space_prefix(False)


def read_vocab(src: Path, vocab_size: int) -> tuple[SentencePieceVocab | None, list[str]]:
    """(the vocabulary, the problems that rule it out)."""
    if not (src / "tokenizer.model").is_file():
        return None, [
            "no tokenizer.model: llama.cpp's converter writes a Gemma 3 vocabulary from the SentencePiece "
            "model (without one it takes the GPT-2 BPE path, which Gemma's tokenizer does not fit)"
        ]
    vocab = SentencePieceVocab(src, vocab_size)
    return (None if vocab.problems else vocab), vocab.problems
