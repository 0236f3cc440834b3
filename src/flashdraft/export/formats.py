"""Engine-ready drafter checkpoints: the z-lab layout and vLLM's speculators layout.

z-lab (docs/dflash.md) is what SGLang, vLLM (`method: "dflash"`) and the reference `dflash`
package load: config.json + model.safetensors, nothing else. The speculators layout is the one
vllm-project/speculators writes for DFlash (`speculators_model_type: "dflash"`) and vLLM reads
through its speculators config path. Its field names follow speculators 0.9.0
(`speculators/convert/dflash/converter.py`, `models/dflash/config.py`) and vLLM's `update_dflash`
(`transformers_utils/configs/speculators/algos.py`): target layers are numbered from the embedding
output (`aux_hidden_state_layer_ids` = z-lab id + 1, which vLLM maps back with - 1), and the weights
are the z-lab ones under the same names (speculators saves neither the embedding nor a full-vocab
lm_head; both come from the verifier at load time).

Both are written under a temporary name and renamed when complete. `gguf` (llama.cpp's DFlash drafter
file) is written by flashdraft.export.gguf_drafter from the same validated checkpoint.

A DFlash2 drafter (`architectures: ["DFlash2DraftModel"]`, docs/dflash.md) adds its settings to
`dflash_config`, `is_causal: false`, and its tensors under the reference package's names (the codebooks
without a `.weight`); speculators 0.9.0 has no DFlash2 layout, so that export refuses one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config

from flashdraft.export.gguf_drafter import write_gguf_drafter
from flashdraft.model.checkpoint import ARCHITECTURES, read_config, read_weights, write_weights_and_config
from flashdraft.model.dflash2 import DFlash2Settings
from flashdraft.model.drafter import DFLASH2_SLIDING, LAST_LAYER

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
FORMATS = ("zlab", "speculators", "gguf")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout `speculators_config` follows

QWEN3_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
)
# config.json keys that describe DFlash rather than the draft transformer (as speculators splits them)
_NOT_TRANSFORMER = (
    "architectures",
    "auto_map",
    "block_size",
    "dflash_config",
    "num_target_layers",
    "eagle_aux_hidden_state_layer_ids",
    "rope_scaling",
    "flashdraft_target",
)
_ARCHITECTURES = [[name] for name in ARCHITECTURES.values()]


def _int_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) for i in value)


def config_problems(cfg: dict) -> list[str]:
    """Everything that keeps config.json from being an engine-loadable z-lab config."""
    problems = [
        f"missing {k}"
        for k in (*QWEN3_FIELDS, "num_target_layers")
        if not isinstance(cfg.get(k), int | float)
    ]
    if cfg.get("architectures") not in _ARCHITECTURES:
        problems.append(f"architectures must be one of {_ARCHITECTURES}, got {cfg.get('architectures')}")
    if cfg.get("model_type") != "qwen3":
        problems.append(f'model_type must be "qwen3", got {cfg.get("model_type")!r}')
    if cfg.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings must be false")
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        problems.append("missing rope_theta")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and len(layer_types) != cfg.get("num_hidden_layers"):
        problems.append(
            f"layer_types has {len(layer_types)} entries for {cfg.get('num_hidden_layers')} layers"
        )
    return problems + _dflash_problems(cfg) + _dflash2_problems(cfg)


def is_dflash2(cfg: dict) -> bool:
    return cfg.get("architectures") == [ARCHITECTURES["dflash2"]]


def _dflash2_problems(cfg: dict) -> list[str]:
    if not is_dflash2(cfg) or not isinstance(cfg.get("dflash_config"), dict):
        return []
    missing = DFlash2Settings.missing(cfg["dflash_config"])
    if missing:
        return [f"dflash_config of a DFlash2 drafter lacks {missing}"]
    settings = DFlash2Settings.from_dflash_config(cfg["dflash_config"])
    problems = settings.problems(cfg.get("hidden_size", 0), cfg.get("vocab_size", 0), prefix="dflash_config.")
    if cfg.get("is_causal"):
        problems.append("is_causal true: a DFlash2 drafter here attends within its block both ways")
    if "sliding_attention" in (cfg.get("layer_types") or []):
        problems.append(DFLASH2_SLIDING)
    return problems


def _dflash_problems(cfg: dict) -> list[str]:
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        return ["missing dflash_config"]
    problems = []
    ids, mask, depth = (
        dflash.get("target_layer_ids"),
        dflash.get("mask_token_id"),
        cfg.get("num_target_layers"),
    )
    if not _int_list(ids):
        problems.append("dflash_config.target_layer_ids must be a non-empty list of layer ids")
    elif isinstance(depth, int) and not all(0 <= i < depth for i in ids):
        problems.append(f"dflash_config.target_layer_ids {ids} outside the target's {depth} layers")
    elif isinstance(depth, int) and depth - 1 in ids:
        problems.append(LAST_LAYER.format(layer=depth - 1))
    eagle = cfg.get("eagle_aux_hidden_state_layer_ids")
    if eagle is not None and _int_list(ids) and eagle != [i + 1 for i in ids]:
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {eagle} must be dflash_config.target_layer_ids + 1 "
            f"({[i + 1 for i in ids]})"
        )
    if not isinstance(mask, int) or not 0 <= mask < cfg.get("vocab_size", 0):
        problems.append(f"dflash_config.mask_token_id {mask!r} is not a row of the vocabulary")
    sizes = {s for s in (cfg.get("block_size"), dflash.get("block_size")) if s is not None}
    if len(sizes) != 1 or not all(isinstance(s, int) and s >= 2 for s in sizes):
        problems.append(
            f"block_size (top level and dflash_config) must be one integer >= 2, got {sorted(sizes)}"
        )
    return problems


def block_size_of(cfg: dict) -> int:
    return int(cfg.get("block_size") or cfg["dflash_config"]["block_size"])


def expected_weights(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a z-lab checkpoint and its shape (no embedding, no lm_head)."""
    d, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {
        "fc.weight": (d, len(cfg["dflash_config"]["target_layer_ids"]) * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    per_layer = {
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (inter, d),
        "mlp.up_proj.weight": (inter, d),
        "mlp.down_proj.weight": (d, inter),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    if cfg.get("attention_bias", False):
        per_layer |= {f"self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv), ("o", d))}
    if is_dflash2(cfg):
        dflash = cfg["dflash_config"]
        kernel, rank = dflash["conv_kernel_size"], dflash["selector_rank"]
        for conv in ("attention_conv", "mlp_conv"):
            per_layer[f"{conv}.base_kernel"] = (2, kernel, d)
            per_layer[f"{conv}.kernel_projection.weight"] = (2 * kernel * d // dflash["conv_group_size"], d)
        shapes |= {
            "candidate_selector.predecessor_codebook": (cfg["vocab_size"], rank),
            "candidate_selector.successor_codebook": (cfg["vocab_size"], rank),
            "candidate_selector.hidden_projection.weight": (rank, d),
        }
    for i in range(cfg["num_hidden_layers"]):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in per_layer.items()}
    return shapes


def weight_problems(cfg: dict, weights: dict[str, torch.Tensor]) -> list[str]:
    expected = expected_weights(cfg)
    problems = [f"missing tensor {k}" for k in sorted(expected.keys() - weights.keys())]
    problems += [f"unexpected tensor {k}" for k in sorted(weights.keys() - expected.keys())]
    problems += [
        f"{k} has shape {tuple(weights[k].shape)}, config implies {shape}"
        for k, shape in expected.items()
        if k in weights and tuple(weights[k].shape) != shape
    ]
    return problems


def read_zlab(ckpt_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a z-lab directory, validated; ValueError lists every problem found."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / WEIGHTS).is_file():
        raise FileNotFoundError(f"{ckpt_dir}: no {WEIGHTS} (not a z-lab checkpoint directory)")
    cfg = read_config(ckpt_dir)
    problems = config_problems(cfg)
    if problems:
        raise ValueError(f"{ckpt_dir / CONFIG}:\n  " + "\n  ".join(problems))
    weights = read_weights(ckpt_dir / WEIGHTS)
    problems = weight_problems(cfg, weights)
    if problems:
        raise ValueError(f"{ckpt_dir / WEIGHTS}:\n  " + "\n  ".join(problems))
    return cfg, weights


def speculators_config(cfg: dict, verifier: str, verifier_architectures: list[str]) -> dict:
    """The speculators config.json of a z-lab config (see the module docstring for the sources)."""
    dflash = cfg["dflash_config"]
    block = block_size_of(cfg)
    # normalised the way speculators serialises it: the non-default fields of a Qwen3Config
    transformer = Qwen3Config(**{k: v for k, v in cfg.items() if k not in _NOT_TRANSFORMER}).to_diff_dict()
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": transformer,
        "draft_vocab_size": cfg["vocab_size"],
        "block_size": block,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
        "mask_token_id": dflash["mask_token_id"],
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "transformers_version": transformers.__version__,
    }


def _write_atomic(out_dir: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a directory to export into")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_weights_and_config(tmp, cfg, weights, torch.bfloat16)
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(tmp, out_dir)
    return out_dir


def verifier_architectures(verifier: str) -> list[str]:
    """`architectures` of the verifier's config.json when it is a local directory; [] otherwise
    (vLLM reads only the verifier's name)."""
    path = Path(verifier) / CONFIG
    return list(json.loads(path.read_text()).get("architectures") or []) if path.is_file() else []


def export_checkpoint(
    ckpt_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    verifier: str | None = None,
    gguf_type: str = "bf16",
) -> Path:
    """Validate a z-lab checkpoint and write it as `fmt` into out_dir (zlab, speculators) or the file
    out_dir (gguf: llama.cpp's DFlash drafter), weights in bf16 (gguf: `gguf_type`, TENSOR_TYPES).

    verifier: the target's hub id or path, recorded in the speculators config (required there); for gguf,
    the target's .gguf file, whose tokenizer the drafter's file takes.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    cfg, weights = read_zlab(ckpt_dir)
    if fmt == "gguf":
        if not verifier:
            raise ValueError(
                "the gguf export takes its tokenizer from the target: give the target's .gguf file"
            )
        return write_gguf_drafter(cfg, weights, verifier, out_dir, gguf_type)
    if fmt == "zlab":
        ids = cfg["dflash_config"]["target_layer_ids"]
        out_cfg = {**cfg, "torch_dtype": "bfloat16", "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids]}
        out_cfg.pop("dtype", None)
    else:
        if is_dflash2(cfg):
            raise ValueError(
                f"speculators {SPECULATORS_VERSION} has no DFlash2 layout: export DFlash2 drafters as zlab "
                "(SGLang, vLLM and the reference package load it) or gguf"
            )
        if not verifier:
            raise ValueError("the speculators layout names its verifier: give the target's hub id or path")
        out_cfg = speculators_config(cfg, verifier, verifier_architectures(verifier))
    return _write_atomic(Path(out_dir), out_cfg, weights)
