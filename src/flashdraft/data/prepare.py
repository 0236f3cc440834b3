"""`flashdraft data prepare`: records -> token shards that training memory-maps, and DIR/stats.json.

Chat records are rendered with the target's chat template; plain-text records ({"prompt",
"completion"}, {"text"}) are tokenized as text where the target has no template (formats.py says which
form is read how).

Two passes. The first streams the source once, in this process: each record is validated (formats.py).
A bad one is copied verbatim to DIR/rejected.jsonl and counted, the first ones also reported as
`FILE:LINE: reason: message`; a good one is appended to an Arrow file. The second tokenizes that file
with `datasets.map` over `num_proc` processes (tokenize.py); records the chat template cannot render or
that leave no loss token are rejected the same way. The map's result is cached under a key of the
validated records, the tokenizer, the options and the tokenizer code, so preparing the same data again
costs one validation pass. The kept documents are written as DIR/shards (`datasets.save_to_disk`, read
back by `packing.load_token_dataset`) with columns id, input_ids, loss_mask and length (so packing never
reads every token list for lengths).

Nothing a run has written is lost to a later one: every output is written into DIR/.prepare-new and
swapped in only when all of it is complete (shards, then rejected.jsonl, then stats.json), so a source
that cannot be read, a --strict stop or a crash leaves DIR's previous outputs whole; a --strict stop's
rejects go to DIR/rejected.stopped.jsonl beside them. A DIR that holds a prepared dataset already is
refused unless `overwrite` is set, and the source may then even be one of DIR's own files (it is read
before anything is swapped).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import multiprocess
import numpy as np

from flashdraft.data import tokenize as tokenize_module
from flashdraft.data.formats import (
    CHAT,
    MAX_RECORD_BYTES,
    PROMPT,
    REASONS,
    TEXT,
    ConversationError,
    RawRecord,
    iter_raw_records,
    parse_record,
)
from flashdraft.data.packing import SHARDS
from flashdraft.data.tokenize import (
    check_tokenizer,
    has_chat_template,
    no_template_message,
    tokenize_conversation,
    tokenize_plain,
    truncate,
)
from flashdraft.run.provenance import tokenizer_sha256

REJECTED = "rejected.jsonl"
STATS = "stats.json"
STOPPED = "rejected.stopped.jsonl"  # the rejects of a run --strict stopped
STAGE = ".prepare-new"
_RECORDS_PER_PROC = 256  # below this many records per process, extra processes cost more than they save
# The tokenizer of each tokenization in progress, by its cache key. Forked worker processes inherit it,
# where datasets would serialize a tokenizer passed as an argument into the work it hands each process:
# with Gemma 3's (262,144 tokens, 28 MB pickled) 8 processes were 6 times slower than one.
_TOKENIZERS: dict[str, object] = {}


@dataclass
class PrepareOptions:
    max_length: int | None = None
    drop_long: bool = False  # over max_length: reject ("too_long") instead of truncating
    enable_thinking: bool | None = None
    chat_template: str | None = None
    num_proc: int = 1
    strict: bool = False  # stop at the first bad record
    split: str = "train"  # for `datasets` sources
    cache_dir: Path | None = None  # tokenization cache; default: the `datasets` cache
    overwrite: bool = False  # replace the prepared dataset DIR holds
    max_record_bytes: int = MAX_RECORD_BYTES  # a longer JSONL line is rejected unread (too_large)


class StrictStop(RuntimeError):
    """--strict met a bad record; the message is its FILE:LINE: reason line."""


SHOWN_REJECTS = 20  # bad records named one by one; a messy dataset's thousands would bury the summary


class Rejects:
    """Bad records: verbatim to DIR/rejected.jsonl, counted by reason, and the first SHOWN_REJECTS named
    through `echo`, one line each; then one line says that the rest are counted, not named."""

    def __init__(self, file: BinaryIO, strict: bool, echo: Callable[[str], None]):
        self.file = file
        self.strict = strict
        self.echo = echo
        self.counts: Counter[str] = Counter()

    def add(self, where: str, raw: bytes, error: ConversationError) -> None:
        self.file.write(raw + b"\n")
        self.file.flush()
        self.counts[error.reason] += 1
        line = f"{where}: {error.reason}: {error}"
        seen = self.counts.total()
        if seen <= SHOWN_REJECTS:
            self.echo(line)
        elif seen == SHOWN_REJECTS + 1:
            self.echo(
                f"more bad records from {where} on: not named here; rejected.jsonl holds each of them and "
                "the summary counts them by reason"
            )
        if self.strict:
            raise StrictStop(line)


def prepare_dataset(
    source: str,
    tokenizer,
    out_dir: str | Path,
    options: PrepareOptions | None = None,
    echo: Callable[[str], None] | None = None,
) -> dict:
    """Validate, tokenize and write DIR/shards, DIR/rejected.jsonl and DIR/stats.json; returns the stats.

    `echo` receives a `FILE:LINE: reason: message` line for each of the first SHOWN_REJECTS bad records
    (default: stderr), then one line saying the rest are counted. Raises
    StrictStop at the first bad record with `options.strict`, SourceError when the source cannot be read,
    ValueError when the tokenizer cannot make loss masks (no chat template, no offsets).
    """
    options = options or PrepareOptions()
    raw = iter_raw_records(source, options.split, options.max_record_bytes)
    return _prepare(raw, source, tokenizer, out_dir, options, echo)


def prepare_records(
    records: Iterable[dict],
    tokenizer,
    out_dir: str | Path,
    echo: Callable[[str], None] | None = None,
    **options,
) -> dict:
    """prepare_dataset for conversations already in memory (OpenAI or ShareGPT dicts); `options` as in
    PrepareOptions. A bad record is reported as `<records>:N` (N counts from 1)."""
    source = "<records>"
    raw = (RawRecord(source, n, json.dumps(r, ensure_ascii=False).encode()) for n, r in enumerate(records, 1))
    return _prepare(raw, source, tokenizer, out_dir, PrepareOptions(**options), echo)


def _prepare(
    raw_records: Iterable[RawRecord],
    source: str,
    tokenizer,
    out_dir: str | Path,
    options: PrepareOptions,
    echo: Callable[[str], None] | None,
) -> dict:
    echo = echo or (lambda line: print(line, file=sys.stderr))
    check_tokenizer(tokenizer)
    out = Path(out_dir)
    held = [name for name in (STATS, SHARDS, REJECTED) if (out / name).exists()]
    if held and not options.overwrite:
        inside = Path(source).resolve().is_relative_to(out.resolve()) if Path(source).exists() else False
        raise ValueError(
            f"{out} holds a prepared dataset ({', '.join(held)})"
            + (f" and the input {source} is one of its files" if inside else "")
            + ": pass --overwrite to replace it (nothing is replaced until the new one is complete), or "
            "write to another --out"
        )
    stage = out / STAGE
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "work").mkdir(parents=True)
    clock = [("start", time.perf_counter())]  # each step's end, for stats' seconds
    try:
        with open(stage / REJECTED, "wb") as rejected_file:
            rejects = Rejects(rejected_file, options.strict, echo)
            chat = has_chat_template(tokenizer, options.chat_template)
            validated, n_read, digest = _validate(
                raw_records, rejects, stage / "work" / "validated.arrow", None if chat else tokenizer
            )
            clock.append(("validate", time.perf_counter()))
            tokenized = _tokenize(validated, tokenizer, options, _cache_key(digest, tokenizer, options))
            clock.append(("tokenize", time.perf_counter()))
            kept = _keep(validated, tokenized, rejects)
            clock.append(("keep", time.perf_counter()))
        _save_shards(kept, stage)
        clock.append(("save", time.perf_counter()))
        stats = _stats(source, tokenizer, options, n_read, tokenized, kept, rejects.counts)
        stats["seconds"] = {name: round(t - clock[i][1], 2) for i, (name, t) in enumerate(clock[1:])}
        (stage / STATS).write_text(json.dumps(stats, indent=2) + "\n")
    except StrictStop:
        os.replace(stage / REJECTED, out / STOPPED)
        raise
    finally:
        shutil.rmtree(stage / "work", ignore_errors=True)
    _swap_in(stage, out)
    return stats


def _swap_in(stage: Path, out: Path) -> None:
    """The complete new outputs replace the old ones: shards (the old set aside until the new is in
    place), rejected.jsonl, then stats.json, which describes them."""
    aside = out / f".{SHARDS}.old"
    shutil.rmtree(aside, ignore_errors=True)
    if (out / SHARDS).exists():
        os.replace(out / SHARDS, aside)
    os.replace(stage / SHARDS, out / SHARDS)
    os.replace(stage / REJECTED, out / REJECTED)
    os.replace(stage / STATS, out / STATS)
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(stage, ignore_errors=True)


def _validate(raw_records: Iterable[RawRecord], rejects: Rejects, arrow_path: Path, no_template=None):
    """Stream the records; bad ones go to `rejects`, good ones to an Arrow file opened as a Dataset.
    `no_template`: the tokenizer when it has no chat template, where a chat record stops the run (every
    one would fail the same way)."""
    import datasets
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    columns = [
        ("id", pa.string()),
        ("messages", pa.list_(message)),
        ("enable_thinking", pa.bool_()),  # null: the option's mode
        ("kind", pa.string()),  # formats.CHAT, PROMPT or TEXT
        ("where", pa.string()),
        ("raw", pa.string()),
    ]
    schema = pa.schema(columns)
    digest, n_read, rows, seen = hashlib.sha256(), 0, [], set()
    with pa.ipc.new_stream(str(arrow_path), schema) as writer:
        for record in raw_records:
            n_read += 1
            try:
                conv = parse_record(record)
                if conv.id in seen:  # as regenerate: one id, one conversation
                    raise ConversationError("duplicate_id", f"id {conv.id!r} seen before")
                seen.add(conv.id)
            except ConversationError as e:
                rejects.add(record.where, record.raw, e)
                continue
            if no_template is not None and conv.kind == CHAT:
                raise ValueError(f"{record.where}: {no_template_message(no_template)}")
            digest.update(conv.id.encode() + b"\0" + record.raw + b"\n")
            row = {"id": conv.id, "messages": conv.messages, "enable_thinking": conv.enable_thinking}
            rows.append({**row, "kind": conv.kind, "where": record.where, "raw": record.raw.decode("utf-8")})
            if len(rows) == 1000:
                writer.write_batch(pa.RecordBatch.from_pylist(rows, schema))
                rows = []
        writer.write_batch(pa.RecordBatch.from_pylist(rows, schema))
    return datasets.Dataset.from_file(str(arrow_path)), n_read, digest.hexdigest()


def _cache_key(records_digest: str, tokenizer, options: PrepareOptions) -> str:
    """Changes with anything that changes the tokenized result, and nothing else."""
    h = hashlib.sha256(records_digest.encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    template = options.chat_template or tokenizer.chat_template
    h.update(json.dumps([template, tokenizer.all_special_tokens]).encode())
    h.update(json.dumps([options.max_length, options.drop_long, options.enable_thinking]).encode())
    h.update(Path(tokenize_module.__file__).read_bytes() + Path(__file__).read_bytes())
    return h.hexdigest()[:32]


def _tokenize(validated, tokenizer, options: PrepareOptions, key: str):
    import datasets

    cache_dir = Path(options.cache_dir or datasets.config.HF_DATASETS_CACHE) / "flashdraft-tokenized"
    cache_dir.mkdir(parents=True, exist_ok=True)
    num_proc = min(options.num_proc, len(validated) // _RECORDS_PER_PROC)
    if num_proc > 1:
        # Forked workers must not inherit a tokenizer thread pool (the known fork deadlock); each worker
        # is one process of the parallelism instead.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "length": datasets.Value("int32"),
            "id": datasets.Value("string"),
            "reject": datasets.Value("string"),
            "error": datasets.Value("string"),
            "truncated": datasets.Value("bool"),
        }
    )
    if len(validated) == 0:  # map over no rows would return no columns at all
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    fn_kwargs = {"options": options, "tokenizer_key": key}
    if num_proc > 1 and multiprocess.get_start_method() != "fork":
        fn_kwargs["tokenizer"] = tokenizer  # a process that is not forked takes it serialized
    _TOKENIZERS[key] = tokenizer
    try:
        return validated.map(
            _tokenize_batch,
            batched=True,
            batch_size=64,
            fn_kwargs=fn_kwargs,
            remove_columns=validated.column_names,
            features=features,
            num_proc=num_proc if num_proc > 1 else None,
            cache_file_name=str(cache_dir / f"tokenized-{key}.arrow"),
            new_fingerprint=key,
            load_from_cache_file=True,
            desc="tokenize",
        )
    finally:
        _TOKENIZERS.pop(key, None)


def _tokenize_batch(batch: dict, options: PrepareOptions, tokenizer_key: str, tokenizer=None) -> dict:
    tokenizer = _TOKENIZERS[tokenizer_key] if tokenizer is None else tokenizer
    keys = ("input_ids", "loss_mask", "length", "id", "reject", "error", "truncated")
    out: dict[str, list] = {k: [] for k in keys}
    rows = zip(batch["id"], batch["messages"], batch["enable_thinking"], batch["kind"], strict=True)
    for record_id, messages, mode, kind in rows:
        try:
            ids, mask, truncated = _tokenize_one(tokenizer, messages, options, mode, kind)
            reject = error = ""
        except ConversationError as e:
            ids, mask, truncated, reject, error = [], [], False, e.reason, str(e)
        for key, value in zip(keys, (ids, mask, len(ids), record_id, reject, error, truncated), strict=True):
            out[key].append(value)
    return out


def _tokenize_one(
    tokenizer, messages: list[dict], options: PrepareOptions, mode: bool | None = None, kind: str = CHAT
) -> tuple[list, list, bool]:
    """One conversation rendered in its own thinking mode (`mode`, from its record) or the options';
    a plain-text record as text where the target has no chat template (TEXT records always)."""
    if kind == TEXT or (kind == PROMPT and not has_chat_template(tokenizer, options.chat_template)):
        prompt = messages[0]["content"] if kind == PROMPT else ""
        ids, mask = tokenize_plain(tokenizer, prompt, messages[-1]["content"])
    else:
        thinking = options.enable_thinking if mode is None else mode
        ids, mask = tokenize_conversation(
            tokenizer, messages, enable_thinking=thinking, chat_template=options.chat_template
        )
    limit = options.max_length
    if limit is None or len(ids) <= limit:
        return ids, mask, False
    if options.drop_long:
        raise ConversationError("too_long", f"{len(ids)} tokens > max length {limit}")
    return *truncate(ids, mask, limit), True


def _keep(validated, tokenized, rejects: Rejects):
    """The tokenized documents that passed; the others go to `rejects` with their source line."""
    reasons = tokenized.data.column("reject").to_pylist()
    bad = [i for i, reason in enumerate(reasons) if reason]
    for i in bad:
        source, result = validated[i], tokenized[i]
        error = ConversationError(result["reject"], result["error"])
        rejects.add(source["where"], source["raw"].encode("utf-8"), error)
    good = np.flatnonzero(np.array([not r for r in reasons], dtype=bool))
    return tokenized.select(good, keep_in_memory=True)


def _save_shards(kept, stage: Path) -> None:
    columns = kept.select_columns(["id", "input_ids", "loss_mask", "length"])
    columns.save_to_disk(str(stage / SHARDS), num_shards=None if len(kept) else 1)  # 0 shards would not load


def _stats(
    source: str, tokenizer, options: PrepareOptions, n_read: int, tokenized, kept, counts: Counter
) -> dict:
    import pyarrow.compute as pc

    lengths, loss_tokens = _token_counts(kept)
    return {
        "source": source,
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),  # checked by `flashdraft train` against the target
        "options": {k: v for k, v in asdict(options).items() if k not in ("chat_template", "cache_dir")},
        "records_read": n_read,
        "kept": len(kept),
        "rejected": sum(counts.values()),
        "rejected_by_reason": {reason: counts.get(reason, 0) for reason in REASONS},
        "truncated": int(pc.sum(tokenized.data.column("truncated")).as_py() or 0),
        "tokens": int(lengths.sum()),
        "loss_tokens": loss_tokens,
        "length_histogram": length_histogram(lengths),
    }


def _token_counts(kept) -> tuple[np.ndarray, int]:
    """Document lengths and the number of loss tokens, read in Arrow batches (never all lists at once)."""
    import pyarrow.compute as pc

    lengths, loss_tokens = [np.zeros(0, dtype=np.int64)], 0
    for batch in kept.with_format("arrow").iter(batch_size=4096):
        lengths.append(batch["length"].to_numpy().astype(np.int64))
        loss_tokens += int(pc.sum(pc.list_flatten(batch["loss_mask"])).as_py() or 0)
    return np.concatenate(lengths), loss_tokens


def length_histogram(lengths: np.ndarray) -> dict[str, int]:
    """Document counts in power-of-two length buckets from 128 up: {"1-128": n, "129-256": n, ...}."""
    if len(lengths) == 0:
        return {}
    edges = [128]
    while edges[-1] < lengths.max():
        edges.append(edges[-1] * 2)
    counts = np.bincount(np.searchsorted(edges, lengths, side="left"), minlength=len(edges))
    lows = [1] + [e + 1 for e in edges[:-1]]
    return {f"{lo}-{hi}": int(n) for lo, hi, n in zip(lows, edges, counts, strict=True)}
