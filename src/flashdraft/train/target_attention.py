"""`train.target_attention: auto`: the target's attention for packed rows, chosen by measurement.

A packed row holds several documents; the target keeps them apart by their position ids, and how fast
that runs depends on the attention implementation and the shape. Under sdpa transformers builds a dense
[S, S] mask per row, which takes SDPA off its flash kernel: on qwen3-8b with six documents in a row of
3,072 the target forward fell from 79% to 62% of the matmul peak, and flex_attention (a block mask that
skips what the documents do not see) brought it to 74%. On SmolLM2-135M flex was slower instead: its
small layers are bound by the host's launches (docs/results.md). So the choice is measured, not
assumed: each candidate runs the features forward on the run's first micro-batch (warm-up first,
then the median of a few), and the fastest is kept. The candidates: the model's own, sdpa,
flex_attention and, where torch has it, varlen (torch's variable-length flash kernel,
flashdraft.model.varlen_attention). A candidate is refused when the documents see each other under it
(the packing probe), or when its features differ from the model's own attention's by more than bf16's
rounding explains, a guard for kernels this module did not write (`AGREE`: the 90th percentile over
tokens of the relative difference of a token's features; on Gemma 3 270M in bf16, sdpa against eager
attention differ by 0.038 there, a leak between documents by 0.61, a window of 64 for 512 by 0.27,
measured on a CPU). The result is remembered per machine, versions, target config and batch shape in
the compile cache folder (a JSON file), so a run that starts again does not measure again.

Measured on a GPU only, and only when the rows pack documents: a row of one document runs the plain
causal kernel, and on a CPU flex_attention has no backward for the packing probe and no speed to win.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashdraft.model import varlen_attention
from flashdraft.model.target import Target

CANDIDATES = ("sdpa", "flex_attention", varlen_attention.NAME)
AGREE = 0.1  # the 90th percentile of the per-token relative differences a candidate may reach
CACHE_FILE = "target_attention.json"


@dataclass
class AttentionChoice:
    name: str
    ms: dict[str, float] = field(default_factory=dict)  # median forward per candidate measured
    differs: dict[str, float] = field(default_factory=dict)  # `_difference` from the model's own
    refused: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not measured
    remembered: bool = False  # read from the cache rather than measured in this run

    def line(self) -> str:
        timed = ", ".join(
            f"{name} {ms:.1f} ms" + (f" ({self.differs[name]:.3f} apart)" if name in self.differs else "")
            for name, ms in self.ms.items()
        )
        refused = "".join(f"; {name} refused: {why}" for name, why in self.refused.items())
        how = "measured earlier on this machine" if self.remembered else "measured on the first batch"
        return (
            f"target attention {self.name} for packed rows ({how}: {timed} a forward{refused}; "
            "train.target_attention overrides)"
        )


def choose_target_attention(
    target: Target,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache_dir: Path | None = None,
    candidates: tuple[str, ...] = CANDIDATES,
    repeats: int = 5,
) -> AttentionChoice:
    """The fastest of the model's own attention and `candidates` for the target's features forward on
    this packed batch, set on the target's model. A candidate the model refuses, that fails to run (a
    kernel that cannot compile for this model: gpt-oss's sinks under flex_attention), under which
    documents leak or whose features differ from the model's own attention's is not kept, and the
    start-up line says why."""
    model = target.model
    original = model.config._attn_implementation
    if not varlen_attention.available():
        candidates = tuple(c for c in candidates if c != varlen_attention.NAME)
    names = tuple(dict.fromkeys((original, *candidates)))
    key = _cache_key(target, input_ids, position_ids, names)
    remembered = _read_cache(cache_dir, key)
    if remembered is not None:
        model.set_attn_implementation(remembered.name)
        return remembered
    choice, own, own_name = AttentionChoice(original), None, original
    for name in names:
        try:
            model.set_attn_implementation(name)
            if target.leaks("positions"):
                choice.refused[name] = "the documents of a row see each other"
                continue
            ms, feats = _median_ms(lambda: target.features(input_ids, position_ids), repeats)
            if own is None:  # the model's own, or the first candidate that runs where it does not
                own, own_name = feats, name
            else:
                differs = _difference(feats, own)
                if differs > AGREE:
                    choice.refused[name] = f"its features differ from {own_name}'s by {differs:.3f}"
                    continue
                choice.differs[name] = round(differs, 4)
            choice.ms[name] = ms
            del feats
        except Exception as e:  # noqa: BLE001 - reported on the start-up line, the others still measured
            choice.refused[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    if not choice.ms:
        model.set_attn_implementation(original)
        raise ValueError(
            "train.target_attention auto: no candidate runs packed rows here ("
            + "; ".join(f"{n}: {why}" for n, why in choice.refused.items())
            + "); set train.target_attention, or data.one_document_per_row: true"
        )
    choice.name = min(choice.ms, key=choice.ms.get)
    model.set_attn_implementation(choice.name)
    _write_cache(cache_dir, key, choice)
    return choice


def _median_ms(forward, repeats: int, warmup: int = 2) -> tuple[float, torch.Tensor]:
    """The median of `repeats` timed forwards after `warmup` untimed ones (compiles, caches), and the
    last forward's output."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(warmup):
        forward()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = forward()
        if cuda:
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return round(statistics.median(times), 2), out


def _difference(feats: torch.Tensor, own: torch.Tensor) -> float:
    """The 90th percentile over tokens of |feats - own| / |own|, each token's features one vector: bf16
    rounding moves a few tokens far (on Gemma 3 270M up to 0.25 between sdpa and eager attention), a
    wrong mask or window moves many."""
    diff = torch.linalg.vector_norm((feats - own).float(), dim=-1)
    size = torch.linalg.vector_norm(own.float(), dim=-1).clamp_min(1e-6)
    return float((diff / size).flatten().quantile(0.9))


def _cache_key(target: Target, input_ids: torch.Tensor, position_ids: torch.Tensor, candidates) -> str:
    """What the measurement depends on: the machine, the versions, the target's config and taps, the
    batch's shape and how its rows are cut into documents."""
    import transformers

    device = input_ids.device
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    starts = (position_ids == 0).sum(dim=1).tolist()  # documents (and padding tokens) a row
    parts = [
        machine, torch.__version__, transformers.__version__, target.config.to_json_string(),
        str(target.layer_ids), str(tuple(input_ids.shape)), str(starts), str(candidates),
    ]  # fmt: skip
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _read_cache(cache_dir: Path | None, key: str) -> AttentionChoice | None:
    if cache_dir is None or not (cache_dir / CACHE_FILE).is_file():
        return None
    try:
        entry = json.loads((cache_dir / CACHE_FILE).read_text()).get(key)
    except (ValueError, AttributeError):
        return None  # a damaged cache file is measured again and rewritten
    if not isinstance(entry, dict) or entry.get("name") not in (entry.get("ms") or {}):
        return None
    return AttentionChoice(
        entry["name"], entry["ms"], entry.get("differs", {}), entry.get("refused", {}), remembered=True
    )


def _write_cache(cache_dir: Path | None, key: str, choice: AttentionChoice) -> None:
    if cache_dir is None:
        return
    path = cache_dir / CACHE_FILE
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        entries = {}
    if not isinstance(entries, dict):
        entries = {}
    entries[key] = {
        "name": choice.name, "ms": choice.ms, "differs": choice.differs, "refused": choice.refused
    }  # fmt: skip
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    tmp.replace(path)
