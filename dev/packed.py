"""A real-target proof's data (SmolLM2 or Gemma 3) carried between GPU machines as a few small files.

A proof directory's prompts and answers (PACKED) are packed on one machine and unpacked into a fresh
proof directory on another; `seed_from_packed` then turns that directory into one whose data stages
continue from those files instead of synthesizing and answering again. dev/smollm2_gpu.sh and
dev/gemma3_gpu.sh run it:

    python3 dev/packed.py files PROOF    # the file names to pack, those PROOF has, on one line
    python3 dev/packed.py seed PROOF     # after unpacking them into PROOF
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashdraft.demo.real_target import _lines, _write_lines

# a chat target's prompts are chat and code, a base model's text and code
PROMPTS = tuple(f"prompts.{kind}.jsonl" for kind in ("chat", "text", "code"))
PACKED = ("conversations.jsonl", *PROMPTS, "summary.json")


def packed_files(out: Path) -> list[str]:
    """The PACKED files the proof directory `out` has."""
    return [name for name in PACKED if (Path(out) / name).is_file()]


def seed_from_packed(out: Path) -> dict:
    """Turn a proof directory unpacked from another run's PACKED files (prompts, answers, summary) into
    one whose data stages continue from them: each temperature's answers file is restored from the
    conversations, and the summary keeps only the target stage (the packed run's data figures under
    `seeded`).
    The prompts and regenerate stages then run again and do only what the files lack: nothing at the
    same scale, the new prompts and their answers at a larger one (`synthesize` resumes past the turns
    it finds, `regenerate_file` skips the ids answered). The scale and the drafter's plan come from the
    next run, as in a new proof. Returns the summary written."""
    out = Path(out)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text())
    missing = {"target", "prompts", "regenerate"} - set(summary.get("stages", []))
    if missing:
        raise ValueError(f"{summary_path}: the packed run lacks the stages {sorted(missing)}")
    by_temperature: dict[str, list[dict]] = {}
    for n, record in enumerate(_lines(out / "conversations.jsonl"), 1):
        base, sep, temperature = record["id"].rpartition("@t")
        if not sep:
            raise ValueError(f"{out / 'conversations.jsonl'}:{n}: id {record['id']!r} names no temperature")
        by_temperature.setdefault(temperature, []).append(record | {"id": base})
    for temperature, records in by_temperature.items():
        _write_lines(out / f"answers.t{temperature}.jsonl", records)
    seconds = summary.get("seconds", {})
    kept = {"stages": ["target"], "seconds": {"target_s": seconds.get("target_s", 0)}}
    kept["seeded"] = {k: summary.get(k) for k in ("answered", "synthesis")} | {"seconds": seconds}
    _write_lines(summary_path, [kept])
    return kept


def main(argv: list[str]) -> None:
    if argv[:1] == ["files"] and len(argv) == 2:
        print(*packed_files(Path(argv[1])))
    elif argv[:1] == ["seed"] and len(argv) == 2:
        seed_from_packed(Path(argv[1]))
    else:
        sys.exit("usage: python3 dev/packed.py files PROOF | seed PROOF")


if __name__ == "__main__":
    main(sys.argv[1:])
