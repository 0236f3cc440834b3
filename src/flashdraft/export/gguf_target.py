"""A Hugging Face target directory as the GGUF file `llama-server -m` serves.

llama.cpp's `convert_hf_to_gguf.py` names a BPE tokenizer's pre-tokenizer by hashing how it splits a
test string, and refuses one it has no hash for ("BPE pre-tokenizer was not recognized"): every
tokenizer trained here, such as the demo's, is one. This module writes the file with the `gguf` package
and names the pre-tokenizer from what tokenizer.json says it does instead: a ByteLevel pre-tokenizer
with its GPT-2 regex is llama.cpp's "gpt-2" (the same regex, in `src/unicode.cpp`,
`unicode_regex_split_custom_gpt2`), and a Split on Qwen2's or Llama 3's regex before a ByteLevel
without one is its "qwen2" or "llama-bpe" (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`).

The rest follows build 11434's converter (`conversion/base.py` `TextModel.set_gguf_parameters` and
`get_vocab_base`, `conversion/llama.py`, `conversion/qwen.py`): tensor names from gguf's own name map,
Llama's q and k rows permuted to llama.cpp's rotary layout (Qwen ropes in the NeoX layout, unpermuted),
matrices in f32 or f16 and norms in f32. What llama.cpp would serve differently from transformers is
refused with the reason: other architectures, RoPE scalings, sliding windows and tokenizers. Gemma 3 text
models (their SentencePiece vocabulary, norms, RoPE per layer kind and sliding window) follow the
converter's `Gemma3Model` in flashdraft.export.gguf_gemma3.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import torch

from flashdraft.export import gguf_gemma3
from flashdraft.export.gguf_drafter import GGUF_SUFFIX, _add_rope, add_layer_shape

# HF architecture -> llama.cpp architecture (conversion/__init__.py maps Mistral to Llama's converter)
ARCHITECTURES = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
}
DTYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}

# Split regexes of tokenizer.json -> (llama.cpp's tokenizer.ggml.pre, the BPE `ignore_merges` it implies)
_SPLIT_PRE = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": ("qwen2", False),
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": ("llama-bpe", True),
}
_SERVED_ROPE = ("default", "linear", "yarn")


def gguf_target_name(target: str | Path, dtype: str = "f32") -> str:
    """The file name a converted target gets: `runs/demo/target` -> `target.f32.gguf`."""
    return f"{Path(target).name}.{dtype}{GGUF_SUFFIX}"


def served_target(target: str | Path, out_dir: str | Path, dtype: str = "f32") -> Path:
    """The .gguf file llama-server serves for `target`: the target itself if it is one, else the HF
    directory converted into out_dir/`gguf_target_name(target)` (rewritten each time, atomically)."""
    path = Path(target)
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        return path
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{target}: llama-server needs the target as a .gguf file or a local Hugging Face directory "
            "(config.json, safetensors, tokenizer.json) to convert"
        )
    return write_gguf_target(path, Path(out_dir) / gguf_target_name(path, dtype), dtype)


def _config(src: Path) -> dict:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(src).to_dict()
    cfg["rope"] = {"rope_theta": cfg.get("rope_theta"), **(cfg.get("rope_parameters") or {})}
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def model_problems(cfg: dict) -> list[str]:
    """What in the HF config llama.cpp would not run as transformers does."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        return [f"architecture {arch}: the target conversion supports {sorted(ARCHITECTURES)}"]
    if ARCHITECTURES[arch] == gguf_gemma3.ARCH:
        return gguf_gemma3.model_problems(cfg)
    problems = []
    rope_type = cfg["rope"].get("rope_type", "default")
    if rope_type not in _SERVED_ROPE:
        problems.append(f"rope_type {rope_type!r}: the conversion writes RoPE only for {list(_SERVED_ROPE)}")
    if cfg.get("use_sliding_window", True) and cfg.get("sliding_window"):
        problems.append(
            f"sliding_window {cfg['sliding_window']}: llama.cpp's {arch} graph attends to every key"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r}: llama.cpp's {arch} graph runs SiLU")
    if ARCHITECTURES[arch] == gguf.MODEL_ARCH.QWEN3 and cfg.get("attention_bias"):
        problems.append("attention_bias: llama.cpp's qwen3 graph has no attention biases")
    return problems


def bpe_pre_tokenizer(state: dict) -> tuple[str | None, list[str]]:
    """(llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json, the problems that rule it out)."""
    model, pre = state.get("model") or {}, state.get("pre_tokenizer") or {}
    problems = []
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        problems.append(
            f"model {model.get('type')} (byte_fallback {model.get('byte_fallback')}): not a byte-level BPE"
        )
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        problems.append("a BPE with subword prefixes or suffixes")
    if (state.get("decoder") or {}).get("type") != "ByteLevel":
        problems.append(f"decoder {(state.get('decoder') or {}).get('type')}: not ByteLevel")
    # Qwen's tokenizers normalize to NFC; llama.cpp applies no normalizer (its own conversion of Qwen
    # neither), which tokenizes text already in NFC, as most is, the same
    normalizer = (state.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        problems.append(f"normalizer {normalizer}: llama.cpp's BPE applies none")
    name, ignore_merges = None, False
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        name = "gpt-2"
    elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        regex = (split.get("pattern") or {}).get("Regex")
        if (
            split.get("type") == "Split"
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space")
            and regex in _SPLIT_PRE
        ):
            name, ignore_merges = _SPLIT_PRE[regex]
    if name is None:
        problems.append(
            f"pre-tokenizer {json.dumps(pre)[:300]}: supported are ByteLevel with its GPT-2 regex, and a "
            "Split on Qwen2's or Llama 3's regex before ByteLevel"
        )
    elif bool(model.get("ignore_merges")) != ignore_merges:
        problems.append(
            f"ignore_merges {model.get('ignore_merges')}: llama.cpp's {name} uses {ignore_merges}"
        )
    return (None if problems else name), problems


def _token_list(state: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their llama.cpp types, as `get_vocab_base` writes them ([PADi] where no token)."""
    by_id = {i: t for t, i in state["model"]["vocab"].items()}
    added = {t["id"]: t for t in state.get("added_tokens", [])}
    by_id |= {i: t["content"] for i, t in added.items()}
    if max(by_id) >= vocab_size:
        raise ValueError(
            f"tokenizer.json has token id {max(by_id)}, the model's vocabulary {vocab_size} rows"
        )
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(token)
        if i not in added:
            types.append(gguf.TokenType.NORMAL)
        elif added[i].get("special") or (token.startswith("<|") and token.endswith("|>")):
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.USER_DEFINED)
    return tokens, types


def _add_tokenizer(writer: gguf.GGUFWriter, src: Path, pre: str, state: dict, vocab_size: int) -> None:
    from flashdraft.model.target import load_tokenizer

    tokens, types = _token_list(state, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    tokenizer = load_tokenizer(src)
    special = {
        writer.add_bos_token_id: tokenizer.bos_token_id,
        writer.add_eos_token_id: tokenizer.eos_token_id,
        writer.add_pad_token_id: tokenizer.pad_token_id,
        writer.add_unk_token_id: tokenizer.unk_token_id,
    }
    for add, token_id in special.items():
        if token_id is not None:
            add(token_id)
    bos = tokenizer.bos_token_id
    writer.add_add_bos_token(bos is not None and tokenizer("a").input_ids[:1] == [bos])
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _add_shape(writer: gguf.GGUFWriter, cfg: dict, arch: gguf.MODEL_ARCH, dtype: str) -> None:
    add_layer_shape(writer, cfg)
    if arch != gguf_gemma3.ARCH:  # Gemma 3's RoPE differs by layer kind (gguf_gemma3.add_shape)
        _add_rope(writer, cfg["rope"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(DTYPES[dtype])
    if arch == gguf.MODEL_ARCH.LLAMA:  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg["head_dim"])
    elif arch == gguf_gemma3.ARCH:
        gguf_gemma3.add_shape(writer, cfg)


def _rotary_layout(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Llama's q/k rows (or biases) as llama.cpp stores them: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Weights:
    """The directory's safetensors, one file or shards, read one tensor at a time."""

    def __init__(self, src: Path):
        from safetensors import safe_open

        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{src}: no .safetensors weights (the conversion reads no .bin checkpoints)")
        self.handles = [safe_open(f, "pt") for f in files]
        self.where = {name: h for h in self.handles for name in h.keys()}  # noqa: SIM118 (not iterable)

    def shape(self, name: str) -> list[int]:
        return self.where[name].get_slice(name).get_shape()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)


def _tensor_plan(weights: _Weights, cfg: dict, arch: gguf.MODEL_ARCH) -> dict[str, str]:
    """HF tensor name -> GGUF name; a tensor the name map does not know is an error."""
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    plan, unknown = {}, []
    for name in sorted(weights.where):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            unknown.append(name)
        else:
            plan[name] = mapped
    if unknown:
        raise ValueError(f"tensors llama.cpp's {arch.name.lower()} graph has no place for: {unknown[:5]}")
    if cfg.get("tie_word_embeddings"):
        # one matrix for both ends, stored under either name: llama.cpp reads it as token_embd and, with
        # no output tensor, uses it for the lm_head too
        by_gguf = {v: k for k, v in plan.items()}
        kept = by_gguf.get("token_embd.weight") or by_gguf.get("output.weight")
        plan = {k: v for k, v in plan.items() if v not in ("token_embd.weight", "output.weight")}
        if kept is not None:
            plan[kept] = "token_embd.weight"
    return plan


def _stored_dtype(ndim: int, dtype: str) -> np.dtype:
    """Matrices in `dtype`, norms and biases in f32, as the converter stores them."""
    return np.dtype(np.float16 if dtype == "f16" and ndim > 1 else np.float32)


def _converted(weights: _Weights, name: str, cfg: dict, arch: gguf.MODEL_ARCH, dtype: str) -> np.ndarray:
    w = weights[name].float()
    if arch == gguf.MODEL_ARCH.LLAMA:  # LlamaModel.permute: k has the KV heads
        if ".q_proj." in name:
            w = _rotary_layout(w, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            w = _rotary_layout(w, cfg["num_key_value_heads"])
    elif arch == gguf_gemma3.ARCH:
        w = gguf_gemma3.converted(name, w)
    return w.numpy().astype(_stored_dtype(w.ndim, dtype))


def write_gguf_target(src: str | Path, out: str | Path, dtype: str = "f32") -> Path:
    """Write the HF target directory `src` as a GGUF llama-server serves at `out` (replaced atomically).
    ValueError lists what llama.cpp would not serve as transformers runs it."""
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {list(DTYPES)}")
    cfg = _config(src)
    problems = model_problems(cfg)
    arch = ARCHITECTURES.get((cfg.get("architectures") or ["?"])[0])
    if arch == gguf_gemma3.ARCH:
        spm, vocab_problems = gguf_gemma3.read_vocab(src, cfg["vocab_size"])
    else:
        tokenizer_json = src / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ValueError(f"{src}: no tokenizer.json (the conversion reads fast tokenizers only)")
        state = json.loads(tokenizer_json.read_text())
        pre, vocab_problems = bpe_pre_tokenizer(state)
    problems += vocab_problems
    if problems:
        raise ValueError(
            f"{src}: llama.cpp cannot serve this target as transformers runs it:\n  " + "\n  ".join(problems)
        )
    weights = _Weights(src)
    plan = _tensor_plan(weights, cfg, arch)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(src.name)
    _add_shape(writer, cfg, arch, dtype)
    if arch == gguf_gemma3.ARCH:
        spm.add_to(writer, src)
    else:
        _add_tokenizer(writer, src, pre, state, cfg["vocab_size"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, gguf_name in plan.items():  # shapes first, then the data one tensor at a time
        shape = weights.shape(name)
        stored = _stored_dtype(len(shape), dtype)
        writer.add_tensor_info(gguf_name, shape, stored, math.prod(shape) * stored.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in plan:
        writer.write_tensor_data(_converted(weights, name, cfg, arch, dtype))
    writer.close()
    os.replace(tmp, out)
    return out
