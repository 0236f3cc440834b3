"""`flashdraft data prompts`: prompts for a base model cut from text the user points at.

A target without a chat template is prompted with text to continue. Where the user has no dataset but
has text of the kind the drafter will serve (a source tree for code completion, documents), each file is
cut at line starts into prefixes: a prompt is a run of whole lines ending before a cut, at most
`max_tokens` long (lines are dropped from its start to fit) and at least `min_tokens`. `data regenerate`
then continues each with the target, so that the drafter learns what the target writes after such text.

Cuts are drawn per file from a generator seeded by the seed and the file's relative path, so the same
command gives the same prompts whatever else the input holds. A file that is not UTF-8 text, or holds a
NUL byte, is named and skipped (a source tree holds images and archives); an input with no usable file is
an error.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from flashdraft.data.humaneval import write_prompts


@dataclass
class PrefixSummary:
    files: int  # text files read
    skipped: list[str]  # files that are not text: not UTF-8, or holding NUL bytes
    prompts: int


def input_files(
    paths: list[str | Path], pattern: str, exclude: tuple[str, ...] = ()
) -> list[tuple[Path, str]]:
    """(file, its name relative to the input it came from) for every file under `paths` (a directory
    is walked for names matching `pattern`, skipping folders named in `exclude`), in a fixed order."""
    files = []
    for p in map(Path, paths):
        if p.is_file():
            files.append((p, p.name))
        elif p.is_dir():
            found = [(f, f.relative_to(p)) for f in sorted(p.rglob(pattern)) if f.is_file()]
            files += [(f, str(rel)) for f, rel in found if not set(rel.parts[:-1]) & set(exclude)]
        else:
            raise ValueError(f"--input {p}: no such file or directory")
    return files


def cut_prefixes(
    text: str, line_tokens: list[int], min_tokens: int, max_tokens: int, count: int, rng: random.Random
) -> list[tuple[str, str]]:
    """Up to `count` prompts of `text` as ("FIRST-LAST" line numbers, text): lines a..b-1 for distinct
    cuts b drawn among the line starts, each within [min_tokens, max_tokens] by `line_tokens` (each
    line's token count)."""
    lines = text.splitlines(keepends=True)
    cuts = list(range(1, len(lines) + 1))
    rng.shuffle(cuts)
    prompts = []
    for b in cuts:
        a, total = b, 0
        while a > 0 and total + line_tokens[a - 1] <= max_tokens:
            a -= 1
            total += line_tokens[a]
        if total >= min_tokens and "".join(lines[a:b]).strip():
            prompts.append((a, b, "".join(lines[a:b])))
            if len(prompts) == count:
                break
    return [(f"{a + 1}-{b}", text) for a, b, text in sorted(prompts)]


def write_prefix_prompts(
    paths: list[str | Path],
    tokenizer,
    out: str | Path,
    min_tokens: int = 16,
    max_tokens: int = 256,
    per_file: int = 4,
    seed: int = 0,
    pattern: str = "*",
    exclude: tuple[str, ...] = (),
    count: int | None = None,
) -> PrefixSummary:
    """Prompts cut from every text file under `paths`, written to `out` as {"id": "NAME:FIRST-LAST"
    (its lines), "prompt"} JSONL (aside, then renamed: a run cut short leaves no partial file). With
    `count`, the files are read in an order shuffled by `seed` until `count` prompts are cut (a large
    tree is not read whole)."""
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"--min-tokens {min_tokens} and --max-tokens {max_tokens}: need 0 < min <= max")
    summary, records = PrefixSummary(0, [], 0), []
    files = input_files(paths, pattern, exclude)
    if count is not None:
        random.Random(seed).shuffle(files)
    for path, name in files:
        if count is not None and len(records) >= count:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or "\0" in text:  # binary: not UTF-8, or NUL bytes, which no text file holds
            summary.skipped.append(str(path))
            continue
        summary.files += 1
        lines = text.splitlines(keepends=True)
        if not lines:
            continue
        counts = [len(ids) for ids in tokenizer(lines, add_special_tokens=False).input_ids]
        rng = random.Random(f"{seed}:{name}")
        for lines_cut, prompt in cut_prefixes(text, counts, min_tokens, max_tokens, per_file, rng):
            records.append({"id": f"{name}:{lines_cut}", "prompt": prompt})
    if not records:
        raise ValueError(
            f"no prompt of {min_tokens}-{max_tokens} tokens in {summary.files} text files under "
            f"{', '.join(map(str, paths))}"
            + (f" ({len(summary.skipped)} not text)" if summary.skipped else "")
        )
    records = records[:count] if count is not None else records
    write_prompts(records, out)
    summary.prompts = len(records)
    return summary
