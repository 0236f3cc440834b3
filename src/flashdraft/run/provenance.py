"""What a run was trained on, checked before it trains: the data against the target, and on resume the
data and target against the run's own record.

- A token dataset records the tokenizer it was made with (`tokenizer_sha256` in DIR/stats.json: its
  vocabulary and chat template); a target whose tokenizer differs is refused, and so is a dataset whose
  token ids do not fit the target's embedding (which would fail at step 1 with an IndexError).
- A run records its data (the dataset's fingerprint and size) and its target (its name, class and a
  hash of a sample of its weights: embedding, lm_head and norm rows, enough to tell two checkpoints of
  one shape apart) in RUN/config.yaml; `--resume` with other data or another target is refused.
Hand-written: the checks are flashdraft's own contract between `data prepare`, `train` and `--resume`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def tokenizer_sha256(tokenizer) -> str:
    """Its vocabulary (token -> id) and chat template, hashed."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    blob = json.dumps({"vocab": vocab, "chat_template": tokenizer.chat_template}, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def weights_sha256(model) -> str:
    """A hash of a fixed sample of the target's weights that every rank holds however many decoder
    layers it loads (`load_target(layers=...)`): the first and last rows of its embedding and output
    embedding, and the 1-D weights outside the decoder layers (the final norm), in float32."""
    from flashdraft.model.target import decoder_layers

    h = hashlib.sha256()
    tables = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    rows = [t[:8] for t in tables] + [t[-8:] for t in tables]
    in_layers = {id(p) for p in decoder_layers(model)[2].parameters()}
    norms = [p for _, p in sorted(model.named_parameters()) if p.dim() == 1 and id(p) not in in_layers]
    for t in rows + norms:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def check_data_fits_target(data_dir: str | Path, dataset, tokenizer, embedding_rows: int) -> None:
    """The dataset was made with this target's tokenizer and its ids are rows of its embedding."""
    import pyarrow.compute as pc

    stats_path = Path(data_dir) / "stats.json"
    if stats_path.is_file():
        recorded = json.loads(stats_path.read_text()).get("tokenizer_sha256")
        if recorded and recorded != tokenizer_sha256(tokenizer):
            made_with = json.loads(stats_path.read_text()).get("tokenizer") or "another tokenizer"
            raise ValueError(
                f"{data_dir} was prepared with {made_with}, whose tokenizer differs from the target's "
                "(vocabulary or chat template): prepare it again with this --target"
            )
    ids = dataset.with_format("arrow").data.column("input_ids")
    top = pc.max(pc.list_flatten(ids)).as_py() if len(dataset) else None
    if top is not None and top >= embedding_rows:
        raise ValueError(
            f"{data_dir}: token id {top} is beyond the target's {embedding_rows}-row embedding: the data "
            "was made for another model; prepare it again with this --target"
        )


def run_record(target_path: str, model, data_dir: str | Path, dataset) -> dict:
    """What RUN/config.yaml records of the run's target and data, to be checked on resume."""
    return {
        "target": str(target_path),
        "target_class": type(model).__name__,
        "target_sample_sha256": weights_sha256(model),
        "data_dir": str(data_dir),
        "data_fingerprint": f"{getattr(dataset, '_fingerprint', '')}:{len(dataset)}",
    }


def check_resume_record(saved: dict, now: dict, run: Path) -> None:
    """A resumed run has the target and data it started with (where its config.yaml recorded them)."""
    changed = [
        k
        for k in ("target_class", "target_sample_sha256", "data_fingerprint")
        if k in saved and saved[k] != now[k]
    ]
    if changed:
        what = "the target" if any(k.startswith("target") for k in changed) else "the data"
        raise ValueError(
            f"cannot resume {run}: {what} is not the one it was trained on (it recorded target "
            f"{saved.get('target')} and data {saved.get('data_dir')}; now target {now['target']} and data "
            f"{now['data_dir']}; differing: {', '.join(changed)})"
        )
