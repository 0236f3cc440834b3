"""`data prepare` against generated hostile input: a seeded mix of good and malformed records (encodings,
nesting, sizes, content parts, tool turns, duplicate ids, assistant-first turns) in plain, gzip and
byte-order-marked files. Every record read is kept or rejected with its reason, nothing crashes, and a
huge line is rejected without being held in memory."""

import gzip
import json
import random
import subprocess
import sys

import pytest

from flashdraft.data import prepare as prepare_module
from flashdraft.data.formats import REASONS
from flashdraft.data.prepare import PrepareOptions, prepare_dataset


def _turns(rng: random.Random) -> list[dict]:
    n = rng.randint(1, 3)
    turns = []
    for k in range(n):
        turns += [{"role": "user", "content": f"question {k} " * rng.randint(1, 5)},
                  {"role": "assistant", "content": f"answer {k} " * rng.randint(1, 8)}]  # fmt: skip
    return turns


def _record(rng: random.Random, i: int) -> tuple[bytes, str | None]:
    """One line and the reason it must be rejected for (None: it is a good record)."""
    kind = rng.choice(
        ["good", "good", "good", "parts", "malformed", "utf8", "nested", "tool", "assistant_first",
         "duplicate", "not_object", "empty_answer", "number_content", "image_part"]
    )  # fmt: skip
    good = {"id": f"r{i}", "messages": _turns(rng)}
    if kind == "good":
        return json.dumps(good).encode(), None
    if kind == "parts":  # OpenAI's list of text parts: joined, kept
        good["messages"][0]["content"] = [
            {"type": "text", "text": "part one "},
            {"type": "text", "text": "two"},
        ]
        return json.dumps(good).encode(), None
    if kind == "malformed":
        return json.dumps(good).encode()[: rng.randint(1, 20)], "malformed_json"
    if kind == "utf8":
        return json.dumps(good).encode().replace(b"question", b"qu\xe9stion", 1), "invalid_utf8"
    if kind == "nested":
        return b"[" * 100_000 + b"]" * 100_000, "malformed_json"
    if kind == "tool":
        good["messages"].insert(2, {"role": "tool", "content": "42"})
        return json.dumps(good).encode(), "tool_turn"
    if kind == "assistant_first":
        good["messages"].insert(0, {"role": "assistant", "content": "Hello!"})
        return json.dumps(good).encode(), "assistant_first"
    if kind == "duplicate":  # the first of these is kept, the others are its duplicates
        return json.dumps({**good, "id": "r-dup"}).encode(), "duplicate_id"
    if kind == "not_object":
        return json.dumps([1, 2, 3]).encode(), "bad_structure"
    if kind == "empty_answer":
        good["messages"][1]["content"] = "  "
        return json.dumps(good).encode(), "empty_assistant"
    if kind == "number_content":
        good["messages"][0]["content"] = 7
        return json.dumps(good).encode(), "non_string_content"
    good["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "x"}}]
    return json.dumps(good).encode(), "non_text_content"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("packaging", ["plain", "gzip", "bom"])
def test_every_record_of_a_hostile_mix_is_kept_or_rejected_for_its_reason(
    tiny_tokenizer, tmp_path, seed, packaging, monkeypatch
):
    monkeypatch.setattr(prepare_module, "SHOWN_REJECTS", 1000)  # every bad record named, to check its reason
    rng = random.Random(seed)
    lines, expected, first_dup = [], {}, True
    for i in range(40):
        raw, reason = _record(rng, i)
        if reason == "duplicate_id" and first_dup:
            reason, first_dup = None, False
        lines.append(raw)
        expected[len(lines)] = reason
    data = b"\n".join(lines) + b"\n\n"
    path = tmp_path / ("mix.jsonl.gz" if packaging == "gzip" else "mix.jsonl")
    if packaging == "gzip":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes((b"\xef\xbb\xbf" if packaging == "bom" else b"") + data)
    said: list[str] = []
    options = PrepareOptions(cache_dir=tmp_path / "c")
    stats = prepare_dataset(str(path), tiny_tokenizer, tmp_path / "out", options, said.append)
    assert stats["records_read"] == len(lines) == stats["kept"] + stats["rejected"]
    assert set(stats["rejected_by_reason"]) == set(REASONS)
    rejected = {int(line.split(":")[1]): line.split(": ")[1] for line in said}
    for n, reason in expected.items():
        assert rejected.get(n) == reason, f"line {n}: expected {reason}, reported {rejected.get(n)}"
    assert stats["kept"] == sum(r is None for r in expected.values())
    assert (tmp_path / "out" / "rejected.jsonl").read_bytes().count(b"\n") == stats["rejected"]


PREPARE_AND_REPORT_MEMORY = """
import resource, sys
from flashdraft.cli.data import data_app
sys.argv = ["flashdraft-data", "prepare", *sys.argv[1:]]
try:
    data_app()
except SystemExit as e:
    code = e.code
print("maxrss_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def test_a_huge_line_is_rejected_without_being_held_in_memory(tiny_target_dir, tmp_path):
    """A 48 MB line among good ones, with a 1 MB record limit: rejected as too_large in a process whose
    peak memory stays far below what reading it would take (json and the tokenizer hold several copies)."""
    good = json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b c"}]}
    )
    huge = json.dumps(
        {"messages": [{"role": "user", "content": "x" * (48 << 20)}, {"role": "assistant", "content": "a"}]}
    )
    path = tmp_path / "huge.jsonl"
    path.write_text(f"{good}\n{huge}\n{good.replace('a b c', 'd e f')}\n")
    out = tmp_path / "out"
    script = tmp_path / "prepare_and_report_memory.py"
    script.write_text(PREPARE_AND_REPORT_MEMORY)
    args = ["--target", str(tiny_target_dir), "--input", str(path), "--out", str(out), "--max-record-bytes",
            str(1 << 20), "--num-proc", "1"]  # fmt: skip
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{path}:2: too_large" in proc.stderr
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["kept"], stats["rejected_by_reason"]["too_large"]) == (2, 1)
    maxrss_mb = int(proc.stdout.split("maxrss_kb")[1]) / 1024
    assert maxrss_mb < 1200, f"peak memory {maxrss_mb:.0f} MB"
    assert len((out / "rejected.jsonl").read_bytes()) < 2048  # the rejects line holds its first KiB


def test_regenerate_refuses_to_write_over_its_input(tiny_target_dir, tmp_path):
    from typer.testing import CliRunner

    from flashdraft.cli.main import app

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    args = ["data", "regenerate", "--target", str(tiny_target_dir), "--input", str(path), "--out", str(path),
            "--backend", "local", "--device", "cpu", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "is the --input" in result.output
    assert path.read_text().count("\n") == 1
