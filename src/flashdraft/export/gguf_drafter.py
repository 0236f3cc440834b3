"""A drafter as the GGUF file llama.cpp's DFlash speculative decoding loads (`llama-server -md`).

llama.cpp converts a z-lab directory with `convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET`, but
that script lives in llama.cpp's source tree, not in an installable package, so this module writes the
same file with the `gguf` package. Tensor names, metadata keys and value types follow build 11434's
converter (`conversion/qwen.py`, `DFlashModel`) and its loader (`src/models/dflash.cpp`,
`common/speculative.cpp`):

- `general.architecture` "dflash"; the draft Qwen3 shape under `dflash.*`; `dflash.block_size`;
  `dflash.target_layers` = z-lab `target_layer_ids` + 1 (llama.cpp extracts a layer's input, which is the
  previous layer's output); the mask token as `tokenizer.ggml.mask_token_id`; for a Gemma target
  `dflash.embedding_scale` = sqrt(hidden_size), by which llama.cpp multiplies the target's embedding rows
  of the block (the converter's default for Gemma targets; `Target.embed` trains on the same product);
- the tokenizer: every `tokenizer.*` key of the target's own GGUF, the file llama-server serves, so the
  drafter's vocabulary is the one the server checks it against (the converter rebuilds the same keys
  from the target's HF tokenizer);
- weights as the converter writes a bf16 checkpoint: matrices in bf16, norms in f32; no embedding and no
  lm_head (llama.cpp takes the target's).
- DFlash2 (both files name the architecture "dflash"; llama.cpp tells them apart by `selector_hidden.weight`):
  `dflash.{conv_kernel_size,conv_group_size,selector_rank,selector_top_k}`, the output multiplier as
  `dflash.logit_scale` and a cap as `dflash.final_logit_softcapping`; the convolutions as
  `blk.N.{attn,ffn}_conv_base` (f32: a name without `.weight`) and `blk.N.{attn,ffn}_conv_proj.weight`,
  the selector as `selector_{predecessor,successor,hidden}.weight`.

What llama.cpp has no field for (attention biases, an activation other than SiLU, RoPE scaling other
than linear and YaRN, a DFlash2 selector whose top-k lattice does not fit a hidden row) is refused, as
is a target GGUF that does not match the drafter.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import torch

ARCH = "dflash"
GGUF_SUFFIX = ".gguf"

_GLOBAL_TENSORS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
# the dflash_config keys of a DFlash2 drafter that the converter writes as uint32 `dflash.*` keys
_DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_SERVED_ROPE = ("default", "linear", "yarn")


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name for a z-lab tensor (`layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{_LAYER_TENSORS[rest]}"


def _rope(cfg: dict) -> dict:
    return {"rope_theta": cfg.get("rope_theta"), **(cfg.get("rope_parameters") or {})}


def serving_problems(cfg: dict) -> list[str]:
    """What in a valid z-lab config llama.cpp's DFlash drafter has no field for."""
    problems = []
    if cfg.get("attention_bias", False):
        problems.append("attention_bias: llama.cpp's DFlash drafter has no attention biases")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(
            f"hidden_act {cfg['hidden_act']!r}: the converter writes no activation, so llama.cpp runs SiLU"
        )
    rope_type = _rope(cfg).get("rope_type", "default")
    if rope_type not in _SERVED_ROPE:
        problems.append(
            f"rope_type {rope_type!r}: the converter writes RoPE scaling only for {list(_SERVED_ROPE)}"
        )
    top_k = cfg["dflash_config"].get("selector_top_k")
    if top_k is not None and cfg["hidden_size"] < top_k * (top_k + 1):
        problems.append(
            f"selector_top_k {top_k}: llama.cpp packs each position's top-k and k x k pairwise scores into a "
            f"hidden row, which needs hidden_size >= {top_k * (top_k + 1)} (it is {cfg['hidden_size']})"
        )
    return problems


def _open_gguf(path: Path, what: str):
    """The file at `path` opened past its magic, or an error naming `what` gave it: a directory, a
    missing file, another format."""
    if path.is_dir():
        raise ValueError(f"{what} {path}: a directory, not a .gguf file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path}: no such file")
    f = path.open("rb")
    if f.read(4) != b"GGUF":
        f.close()
        raise ValueError(f"{what} {path}: not a GGUF file")
    return f


def read_gguf(path: str | Path, what: str) -> gguf.GGUFReader:
    """The GGUF file at `path` parsed, or an error naming `what` gave it (`_open_gguf`), or a cut or
    damaged file (gguf's reader then raises whatever numpy or struct does)."""
    path = Path(path)
    _open_gguf(path, what).close()
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError, struct.error) as e:
        raise ValueError(f"{what} {path}: a GGUF file that does not parse, truncated? ({e})") from e


def gguf_architecture(path: str | Path, what: str) -> str | None:
    """`general.architecture` of the GGUF file at `path` (errors as `read_gguf`).

    Read from the header's first key where it is, as every writer of llama.cpp's puts it: gguf's reader
    parses the whole file, a view per element of every metadata array, which for a 262,144-token
    vocabulary takes 8 s on one core. Elsewhere (another byte order or key order), the whole parse."""
    path, key = Path(path), b"general.architecture"
    with _open_gguf(path, what) as f:
        # version, tensor count, key count; the first key's length and bytes; its value's type and length
        head = f.read(28 + len(key) + 12)
        if len(head) == 28 + len(key) + 12:
            version, _, _, key_len = struct.unpack_from("<IQQQ", head)
            kind, size = struct.unpack_from("<IQ", head, 28 + len(key))
            first = (version in (2, 3), key_len == len(key), head[28 : 28 + len(key)] == key)
            if all(first) and kind == gguf.GGUFValueType.STRING and size < 256:
                return f.read(size).decode("utf-8", errors="replace")
    return _architecture(read_gguf(path, what))


def _architecture(reader: gguf.GGUFReader) -> str | None:
    field = reader.fields.get("general.architecture")
    return field.contents() if field is not None else None


class TargetGGUF:
    """What the drafter's file takes from the target's GGUF: its tokenizer keys and the shape to check."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.suffix != GGUF_SUFFIX or not path.is_file():
            raise ValueError(
                f"{path}: the gguf export needs the target as the .gguf file llama-server serves "
                "(convert an HF target with llama.cpp's convert_hf_to_gguf.py)"
            )
        reader = read_gguf(path, "--target")
        self.path = path
        self.arch = _architecture(reader)
        if self.arch == ARCH:
            raise ValueError(f"--target {path}: a DFlash drafter's GGUF, not a target")
        self.fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        self.num_layers = self._int(reader, "block_count")
        self.hidden_size = self._int(reader, "embedding_length")
        tokens = self.fields.get("tokenizer.ggml.tokens")
        self.vocab_size = len(tokens.data) if tokens is not None else None
        sections = reader.fields.get(f"{self.arch}.rope.dimension_sections")
        self.mrope = sections is not None and any(sections.contents())

    def _int(self, reader: gguf.GGUFReader, key: str) -> int | None:
        field = reader.fields.get(f"{self.arch}.{key}")
        return int(field.contents()) if field is not None else None

    def problems(self, cfg: dict) -> list[str]:
        """Where the drafter was not made for this target."""
        expect = {
            "layers": (self.num_layers, cfg["num_target_layers"]),
            "hidden size": (self.hidden_size, cfg["hidden_size"]),
            "vocabulary": (self.vocab_size, cfg["vocab_size"]),
        }
        return [
            f"the target has {what} {have}, the drafter was trained for {want}"
            for what, (have, want) in expect.items()
            if have != want
        ]


def _add_tokenizer(writer: gguf.GGUFWriter, target: TargetGGUF, mask_token_id: int) -> None:
    for key, field in target.fields.items():
        if key == gguf.Keys.Tokenizer.MASK_ID:
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)
    writer.add_uint32(gguf.Keys.Tokenizer.MASK_ID, mask_token_id)


def _add_rope(writer: gguf.GGUFWriter, rope: dict) -> None:
    """The RoPE keys the converter writes (`TextModel.set_gguf_parameters`) for the types it serves."""
    kind, factor = rope.get("rope_type", "default"), rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        optional = {
            "extrapolation_factor": writer.add_rope_scaling_yarn_ext_factor,
            "attention_factor": writer.add_rope_scaling_yarn_attn_factor,
            "beta_fast": writer.add_rope_scaling_yarn_beta_fast,
            "beta_slow": writer.add_rope_scaling_yarn_beta_slow,
        }
        for key, add in optional.items():
            if rope.get(key) is not None:
                add(rope[key])
    writer.add_rope_freq_base(rope["rope_theta"])


def add_layer_shape(writer: gguf.GGUFWriter, cfg: dict) -> None:
    """The shape keys of an HF config every llama.cpp architecture reads, in the converter's order."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])


def _add_shape(writer: gguf.GGUFWriter, cfg: dict, file_type: gguf.LlamaFileType) -> None:
    add_layer_shape(writer, cfg)
    if cfg.get("is_causal") is False:  # where `TextModel.set_gguf_parameters` writes it (DFlashModel again)
        writer.add_causal_attention(False)
    _add_rope(writer, _rope(cfg))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(file_type)


def _add_dflash(writer: gguf.GGUFWriter, cfg: dict, target: TargetGGUF) -> None:
    """The DFlash keys of `DFlashModel.set_gguf_parameters`, in its order."""
    dflash = cfg["dflash_config"]
    writer.add_uint32(f"{ARCH}.block_size", dflash.get("block_size", cfg.get("block_size", 16)))
    if "conv_kernel_size" in dflash:
        for key in _DFLASH2_SIZES:
            writer.add_uint32(f"{ARCH}.{key}", int(dflash[key]))
    if dflash.get("output_multiplier") is not None:
        writer.add_logit_scale(float(dflash["output_multiplier"]))
    if float(dflash.get("final_logit_softcapping") or 0) > 0:
        writer.add_final_logit_softcapping(float(dflash["final_logit_softcapping"]))
    if target.arch.startswith("gemma"):  # the scale of the block input it trained on (Target.embed)
        writer.add_embedding_scale(target.hidden_size**0.5)
    writer.add_array(f"{ARCH}.target_layers", [i + 1 for i in dflash["target_layer_ids"]])
    use_swa = cfg.get("use_sliding_window", False) or dflash.get("use_swa", False)
    window = dflash.get("swa_window_size") or cfg.get("sliding_window")
    if use_swa and window:
        layer_types = cfg.get("layer_types") or []
        pattern = (
            [True] * cfg["num_hidden_layers"]
            if dflash.get("use_swa")
            else [t == "sliding_attention" for t in layer_types]
        )
        writer.add_sliding_window(window)
        writer.add_sliding_window_pattern(pattern)
    causal = cfg.get("is_causal", dflash.get("causal"))
    if causal is not None and cfg.get("is_causal") is not False:  # else written with the shape
        writer.add_causal_attention(bool(causal))
    if target.mrope:  # the draft ropes on the temporal dimension only
        writer.add_rope_dimension_sections([cfg["head_dim"] // 2, 0, 0, 0])


# The drafter's matrices in the GGUF: bf16 as llama.cpp's converter writes them (the default), or f32, f16,
# q8_0 (llama.cpp's 8-bit blocks of 32); 1-D tensors and the convolutions' kernels stay f32 in every case.
TENSOR_TYPES = {
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def _add_tensors(writer: gguf.GGUFWriter, weights: dict[str, torch.Tensor], tensor_type: str) -> None:
    """In the converter's order (the safetensors file's, sorted by name) and types (f32 for 1-D tensors and
    names without `.weight`, `tensor_type` for the rest)."""
    qtype = TENSOR_TYPES[tensor_type][0]
    for name in sorted(weights):
        tensor, gguf_name = weights[name].detach().cpu(), gguf_tensor_name(name)
        if tensor.ndim == 1 or not gguf_name.endswith(".weight") or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, tensor.float().numpy())
        elif qtype == gguf.GGMLQuantizationType.BF16:
            bits = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(gguf_name, bits, raw_dtype=qtype)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, tensor.to(torch.float16).numpy())
        else:
            data = gguf.quants.quantize(tensor.float().numpy(), qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)


def write_gguf_drafter(
    cfg: dict,
    weights: dict[str, torch.Tensor],
    target: str | Path,
    out: str | Path,
    tensor_type: str = "bf16",
) -> Path:
    """Write a validated z-lab drafter (config, tensors) as llama.cpp's DFlash GGUF at `out`.

    target: the target's .gguf file (tokenizer and shape come from it); tensor_type: the matrices' type
    (TENSOR_TYPES). ValueError lists every problem.
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists")
    if out.suffix != GGUF_SUFFIX:
        raise ValueError(f"{out}: the gguf export writes one file; name it *{GGUF_SUFFIX}")
    target_file = TargetGGUF(target)
    problems = serving_problems(cfg) + target_file.problems(cfg)
    if tensor_type not in TENSOR_TYPES:
        problems.append(f"tensor type {tensor_type!r} is not one of {', '.join(TENSOR_TYPES)}")
    elif tensor_type == "q8_0":
        problems += [
            f"{name}: rows of {t.shape[-1]} do not split into q8_0's blocks of 32"
            for name, t in weights.items()
            if t.ndim > 1 and gguf_tensor_name(name).endswith(".weight") and t.shape[-1] % 32
        ]
    if problems:
        raise ValueError("llama.cpp cannot serve this drafter:\n  " + "\n  ".join(problems))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    writer = gguf.GGUFWriter(tmp, ARCH)
    _add_tensors(writer, weights, tensor_type)
    writer.add_type(gguf.GGUFType.MODEL)
    total = sum(math.prod(t.shape) for t in weights.values())
    writer.add_size_label(gguf.size_label(total, total, 0, 0))
    _add_shape(writer, cfg, TENSOR_TYPES[tensor_type][1])
    _add_dflash(writer, cfg, target_file)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, target_file, cfg["dflash_config"]["mask_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out
