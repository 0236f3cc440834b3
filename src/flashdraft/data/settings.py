"""OUT.settings.json: what the records of a resumable data command's output were written with
(`data regenerate`: the target and its sampling; `data synthesize`: what fixes every batch's samples).
A rerun continues an output only with the same settings: its records would otherwise count as done,
whatever they were written with."""

from __future__ import annotations

import json
import os
from pathlib import Path


def settings_path_for(out_path: str | Path) -> Path:
    return Path(str(out_path) + ".settings.json")


def check_settings(out: Path, settings: dict, has_records: bool) -> None:
    """Refuse `settings` (a JSON-able dict) for `out` when it has records written with others, naming what
    differs; else record them. An output with records but no settings file (written before the file was
    kept) is taken as it is."""
    path = settings_path_for(out)
    if has_records and path.exists():
        recorded = json.loads(path.read_text())
        keys = dict.fromkeys([*recorded, *settings])
        changed = {k: (recorded.get(k), settings.get(k)) for k in keys if recorded.get(k) != settings.get(k)}
        if changed:
            details = "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ValueError(
                f"{out} holds records written with other settings ({path}): {details}. Rerun with the "
                "recorded settings to continue it, or write to another --out"
            )
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=1) + "\n")
    os.replace(tmp, path)
