"""Drafter checkpoints in the z-lab layout (docs/dflash.md), written atomically.

The directory holds config.json and model.safetensors exactly as SGLang, vLLM and the reference
`dflash` package load them. Directories are written under a temporary name and renamed when
complete, so a checkpoint is complete or absent; RUN/checkpoints/LATEST moves last. A checkpoint of a
step that exists already (a finished run resumed) replaces it without a moment where LATEST names
nothing: the old one is renamed aside first and removed only after LATEST names the new one; a process
killed in between leaves the old one aside, which `latest_checkpoint` and `remove_partial_checkpoints`
put back. tests/test_faults.py makes every file operation of a save fail in turn.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from flashdraft.model.dflash2 import DFlash2Settings
from flashdraft.model.drafter import DFlashDrafter

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
LATEST = "LATEST"


def input_embedding_scale(cfg) -> float:
    """The factor of the block's embedding rows a drafter was trained with (Target.embedding_scale)."""
    return float(getattr(cfg, "input_embedding_scale", None) or 1.0)


def zlab_config(drafter: DFlashDrafter) -> dict:
    cfg = drafter.config
    out = cfg.to_dict()
    for key in ("target_layer_ids", "mask_token_id", "block_size", "num_target_layers", "dflash2",
                "input_embedding_scale", *_DERIVED):  # fmt: skip
        out.pop(key, None)
    ids = [int(i) for i in cfg.target_layer_ids]
    out.update(
        architectures=[ARCHITECTURES[drafter.architecture]],
        model_type="qwen3",
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        rope_theta=cfg.rope_parameters["rope_theta"],
        layer_types=list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers),
        num_target_layers=int(cfg.num_target_layers),
        block_size=int(cfg.block_size),
        dflash_config={
            "mask_token_id": int(cfg.mask_token_id),
            "target_layer_ids": ids,
            "block_size": int(cfg.block_size),
            # the factor the block's embedding rows were trained with (a Gemma target's sqrt(hidden_size)),
            # as the reference package and llama.cpp's converter read it; absent: 1
            **({"input_embedding_scale": scale} if (scale := input_embedding_scale(cfg)) != 1.0 else {}),
        },
        # what older vLLM builds read instead of dflash_config: the ids numbered from the embedding output
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids],
    )
    if cfg.rope_parameters.get("rope_type", "default") != "default":  # for loaders that read rope_scaling
        out["rope_scaling"] = {k: v for k, v in cfg.rope_parameters.items() if k != "rope_theta"}
    sliding = "sliding_attention" in out["layer_types"]  # what Qwen3Config keeps a window for
    out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window if sliding else None)
    out.pop("dtype", None)
    if drafter.dflash2 is not None:  # DFlash2 configs say so (docs/dflash.md): the block attends both ways
        out.update(is_causal=False)
        out["dflash_config"].update(drafter.dflash2.as_dict())
    return out


# config.json `architectures` of each drafter architecture, as the reference package names its classes
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# config.json fields written from others (and rebuilt from them when a checkpoint is loaded)
_DERIVED = ("eagle_aux_hidden_state_layer_ids", "rope_scaling", "is_causal")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_zlab(
    drafter: DFlashDrafter, out_dir: Path, dtype: torch.dtype = torch.bfloat16, weights: dict | None = None
) -> None:
    """Write config.json + model.safetensors into an existing directory (fsynced).

    weights: the drafter's full state dict when its own holds shards; default drafter.state_dict().
    """
    weights = drafter.state_dict() if weights is None else weights
    write_weights_and_config(out_dir, zlab_config(drafter), weights, dtype)


def write_weights_and_config(out_dir: Path, cfg: dict, weights: dict, dtype: torch.dtype) -> None:
    """model.safetensors (in `dtype`, on the CPU) and config.json into an existing directory, fsynced:
    the one writer of both files, for checkpoints and every export layout."""
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in sorted(weights.items())}
    save_file(state, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in (WEIGHTS, CONFIG):
        with open(out_dir / name, "rb") as f:
            os.fsync(f.fileno())


def save_checkpoint(
    drafter: DFlashDrafter,
    ckpt_root: Path,
    step: int,
    extra_files: dict | None = None,
    weights: dict | None = None,
) -> Path:
    """RUN/checkpoints/step_NNNNNN, complete or absent; then LATEST names it."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    aside = _aside(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_zlab(drafter, tmp, weights=weights)
    for fname, writer in (extra_files or {}).items():
        writer(tmp / fname)
    _fsync_dir(tmp)
    if final.exists():  # the old one stays whole, under another name, until the new one is in place
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / f".{LATEST}.tmp"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, ckpt_root / LATEST)
    _fsync_dir(ckpt_root)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def _aside(final: Path) -> Path:
    return final.parent / f".replaced-{final.name}"


def prune_checkpoints(ckpt_root: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (never LATEST's, never `protect`).
    Called only after a newer checkpoint is complete (and, with S3, uploaded)."""
    latest = latest_checkpoint(ckpt_root)
    done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    removed = []
    for old in done[:-keep] if keep > 0 else done:
        if old in (latest, protect):
            continue
        shutil.rmtree(old)
        removed.append(old)
    return removed


def remove_partial_checkpoints(ckpt_root: Path) -> None:
    """Undo what a killed save left behind: temporary directories never renamed are deleted; a checkpoint
    set aside for its replacement is put back if the replacement never arrived, else deleted."""
    for tmp in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for aside in ckpt_root.glob(".replaced-*"):
        final = ckpt_root / aside.name.removeprefix(".replaced-")
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint LATEST names (put back first, if a killed save had set it aside), or None."""
    marker = ckpt_root / LATEST
    if not marker.exists():
        return None
    path = ckpt_root / marker.read_text().strip()
    if not path.exists() and _aside(path).is_dir():
        os.replace(_aside(path), path)
    return path


def load_drafter(
    ckpt_dir: str | Path, device: str | torch.device = "cpu", dtype=torch.float32
) -> DFlashDrafter:
    """Rebuild a DFlashDrafter from a z-lab directory (ours or any engine-ready one)."""
    ckpt_dir = Path(ckpt_dir)
    raw = read_config(ckpt_dir)
    dflash = raw.get("dflash_config") or {}
    dflash2 = raw.get("architectures") == [ARCHITECTURES["dflash2"]]
    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
    missing += DFlash2Settings.missing(dflash) if dflash2 else []
    if missing:
        raise ValueError(f"{ckpt_dir / CONFIG}: dflash_config lacks {missing}")
    skip = ("dflash_config", "architectures", "torch_dtype", *_DERIVED)
    fields = {k: v for k, v in raw.items() if k not in skip}
    if "rope_parameters" not in fields:  # a config in the older form: rope_theta and rope_scaling
        scaling = dict(raw.get("rope_scaling") or {})
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        fields["rope_parameters"] = {**scaling, "rope_theta": raw.get("rope_theta", 1e6)}
    cfg = Qwen3Config(**fields)
    cfg.target_layer_ids = list(dflash["target_layer_ids"])
    cfg.mask_token_id = int(dflash["mask_token_id"])
    cfg.block_size = int(dflash.get("block_size", raw.get("block_size", 16)))
    cfg.num_target_layers = int(raw["num_target_layers"])
    if "input_embedding_scale" in dflash:
        cfg.input_embedding_scale = float(dflash["input_embedding_scale"])
    if dflash2:
        cfg.dflash2 = DFlash2Settings.from_dflash_config(dflash).as_dict()
    return drafter_from_state(cfg, read_weights(ckpt_dir / WEIGHTS), device, dtype)


def read_config(ckpt_dir: Path) -> dict:
    """A checkpoint directory's config.json; FileNotFoundError or ValueError naming it."""
    path = Path(ckpt_dir) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir}: no {CONFIG} (not a drafter checkpoint directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def read_weights(path: Path) -> dict:
    """The tensors of a safetensors file; ValueError naming it when it is cut short or not one."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def drafter_from_state(config, state: dict, device, dtype=torch.float32) -> DFlashDrafter:
    """A drafter holding `state` rounded through `dtype` (as a checkpoint saved in it), on `device`."""
    drafter = DFlashDrafter(config)
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return drafter.to(device)
