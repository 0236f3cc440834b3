"""Decoding with the reference `dflash` package (z-lab, `pip install --no-deps dflash==0.1.0`): the
check that an exported drafter gives the reference implementation the acceptance it gives ours."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch


def reference_tau(
    export_dir: Path, target_dir: Path, prompt_ids: list[list[int]], max_new: int, device
) -> dict:
    """Greedy tau of the exported drafter decoded by the reference `dflash` package (z-lab): its DFlash or
    DFlash2 class, as the export's config.json names it."""
    import json

    import dflash.model
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate

    from flashdraft.eval.spec import mean_tau
    from flashdraft.model.target import load_target, stop_token_ids

    if torch.device(device).type == "cpu":  # its stats timer calls torch.cuda.synchronize()
        dflash.model._cuda_time = time.perf_counter
    model, tokenizer = load_target(target_dir, device)
    architectures = json.loads((Path(export_dir) / "config.json").read_text()).get("architectures", [])
    cls = DFlash2DraftModel if "DFlash2DraftModel" in architectures else DFlashDraftModel
    ref = cls.from_pretrained(str(export_dir), dtype=model.dtype).to(device).eval()
    stops = stop_token_ids(model, tokenizer)
    taus = []
    for ids in prompt_ids:
        x = torch.tensor([ids], device=device)
        out = dflash_generate(ref, model, x, max_new, stops, temperature=0.0, return_stats=True)
        lengths = out.acceptance_lengths
        taus.append(sum(lengths) / len(lengths) if lengths else float("nan"))
    return {"tau": mean_tau(taus), "tau_per_sample": taus}


def agreeing(theirs: list[float], ours: list[float]) -> int:
    """Prompts on which two acceptance lengths agree, to the seven significant digits a report keeps
    (a tau of 10.052631... is stored as 10.05263; one cycle more or less moves it by a percent or so)."""
    return sum(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(theirs, ours, strict=True))


def reference_beside_ours(
    checkpoint: Path,
    target: str | Path,
    prompt_ids: list[list[int]],
    ours: list[float],
    max_new: int,
    device,
    export_dir: Path,
) -> dict:
    """The checkpoint exported to the z-lab layout in `export_dir` (kept if already there: the export is
    atomic) and decoded by the reference package at T = 0; `ours` is our DFlash tau on each prompt, and
    `samples_with_our_tau` counts the prompts where the two agree."""
    from flashdraft.export.formats import export_checkpoint

    if not Path(export_dir).exists():
        export_checkpoint(checkpoint, "zlab", export_dir)
    ref = reference_tau(export_dir, target, prompt_ids, max_new, device)
    ref["samples_with_our_tau"] = agreeing(ref["tau_per_sample"], ours)
    ref["our_tau"] = sum(ours) / len(ours)
    return ref
