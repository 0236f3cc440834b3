"""Records in, validated conversations out: the one place that knows the input formats.

`flashdraft data prepare` and `flashdraft data regenerate` both read OpenAI-style
`{"messages": [{"role", "content"}]}` and ShareGPT-style `{"conversations": [{"from", "value"}]}` chat
records, and two plain-text forms for targets without a chat template (base models):
`{"prompt": ..., "completion": ...}` (the completion is what the loss covers; regeneration writes it, so
there it may be missing) and `{"text": ...}` (all of it). One rule decides how a prompt record is read: a
user turn and its answer for a target with a chat template, plain text continued for one without
(`Conversation.kind`). They are read from JSONL, a JSON array, Parquet, or anything
`datasets.load_dataset` loads (a hub id, a local dataset folder); JSONL and JSON files may be compressed
(.gz, .bz2, .xz) and may start with a UTF-8 byte-order mark. Each record keeps where it came from
(FILE:LINE; the row number for Parquet and datasets) and its raw bytes, so a bad one is reported where it
is and copied verbatim to a rejects file instead of vanishing. A line longer than MAX_RECORD_BYTES is never
held whole: it is read in chunks, rejected as `too_large`, and its rejects line holds its first KiB, so
memory stays bounded whatever the input. Validation failures are `ConversationError`s carrying a short
reason code that stats files count by.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Every reason a record can be turned away for, in the order stats files list them.
REASONS = (
    "invalid_utf8",
    "malformed_json",
    "bad_structure",
    "bad_id",
    "unknown_role",
    "non_string_content",
    "missing_assistant",
    "empty_assistant",
    "template_error",
    "too_long",
    "no_loss_tokens",
    "too_large",
    "duplicate_id",
    "assistant_first",
    "tool_turn",
    "non_text_content",
    "no_chat_template",
)
MAX_RECORD_BYTES = 16 << 20  # a conversation of millions of tokens: larger lines are refused unread
_BOM = b"\xef\xbb\xbf"
_COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}
_TOOL_ROLES = ("tool", "function", "ipython")

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
}


class ConversationError(ValueError):
    """One record is unusable; `reason` is a short code (see REASONS), the message says what is wrong."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class SourceError(ValueError):
    """The source as a whole is unusable (missing, not loadable, not a valid JSON array)."""


@dataclass(frozen=True)
class RawRecord:
    source: str
    line: int
    raw: bytes
    oversize: int = 0  # the line's size when over MAX_RECORD_BYTES (raw then holds its first KiB only)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def default_id(self) -> str:
        """The id of a record that has none: stable across runs however the path was spelled."""
        return f"{Path(self.source).name}:{self.line}"


CHAT, PROMPT, TEXT = "chat", "prompt", "text"  # Conversation.kind: the record's form


@dataclass
class Conversation:
    """A validated record as messages. kind CHAT: a conversation. PROMPT: a {"prompt", "completion"}
    record as one user turn and its answer (the answer's content empty when it has none yet). TEXT: a
    {"text"} record as one assistant turn, all of it trained on."""

    id: str
    messages: list[dict[str, str]]
    where: str = ""  # FILE:LINE it was read from
    enable_thinking: bool | None = None  # the mode its answers were written in (Qwen3-style templates)
    kind: str = CHAT

    def to_json(self) -> dict:
        if self.kind == TEXT:
            return {"id": self.id, "text": self.messages[0]["content"]}
        if self.kind == PROMPT:
            return {"id": self.id, "prompt": self.messages[0]["content"], "completion": self.completion}
        mode = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return {"id": self.id, "messages": self.messages, **mode}

    @property
    def prompt(self) -> str:
        """A PROMPT or TEXT record's text before what the loss covers ("" for TEXT)."""
        return self.messages[0]["content"] if self.kind == PROMPT else ""

    @property
    def completion(self) -> str:
        """A PROMPT or TEXT record's text that the loss covers."""
        return self.messages[-1]["content"] if self.messages[-1]["role"] == "assistant" else ""


def with_reasoning(content: str, reasoning: str) -> str:
    """Fold separately delivered reasoning into the content the way thinking templates (Qwen3) split it."""
    return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"


# ---------------------------------------------------------------------------------------------- reading


def iter_raw_records(
    source: str, split: str = "train", max_record_bytes: int = MAX_RECORD_BYTES
) -> Iterator[RawRecord]:
    """Every record of `source` in order: a JSONL, JSON-array or Parquet file, else a `datasets` dataset;
    a JSONL line over `max_record_bytes` comes as an unread `oversize` record."""
    path = Path(source)
    suffix = _inner_suffix(path)
    if path.is_file():
        if suffix == ".parquet":
            yield from _parquet_records(path, source)
        elif suffix != ".jsonl" and _starts_with_bracket(path):
            yield from _json_array_records(path, source)
        else:
            yield from _jsonl_records(path, source, max_record_bytes)
    elif suffix in (".jsonl", ".json", ".parquet"):  # a file name, not a dataset id: fail now, offline
        raise SourceError(f"{source}: no such file")
    else:
        yield from _dataset_records(source, split)


def _inner_suffix(path: Path) -> str:
    """The format's suffix, under a compression suffix if there is one (data.jsonl.gz -> .jsonl)."""
    return Path(path.stem).suffix if path.suffix in _COMPRESSED else path.suffix


def _open_binary(path: Path):
    if path.suffix in _COMPRESSED:
        return __import__(_COMPRESSED[path.suffix]).open(path, "rb")
    return open(path, "rb")


def count_records(source: str, split: str = "train") -> int:
    path = Path(source)
    if path.is_file() and path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(1 for _ in iter_raw_records(source, split))


def _jsonl_records(path: Path, source: str, limit: int = MAX_RECORD_BYTES) -> Iterator[RawRecord]:
    try:
        with _open_binary(path) as f:
            n = 0
            while line := f.readline(limit + 1):
                n += 1
                if n == 1:
                    line = line.removeprefix(_BOM)
                if len(line) > limit and not line.endswith(b"\n"):  # read the rest in chunks, keep none
                    size = len(line)
                    while (more := f.readline(1 << 20)) and not more.endswith(b"\n"):
                        size += len(more)
                    yield RawRecord(source, n, line[:1024], oversize=size + len(more))
                elif line.strip():
                    yield RawRecord(source, n, line.rstrip(b"\r\n"))
    except (OSError, EOFError) as e:  # a corrupt or truncated compressed file
        raise SourceError(f"{source}: cannot read: {e}") from e


def _starts_with_bracket(path: Path) -> bool:
    try:
        with _open_binary(path) as f:
            while chunk := f.read(4096):
                stripped = chunk.removeprefix(_BOM).lstrip()
                if stripped:
                    return stripped.startswith(b"[")
    except (OSError, EOFError) as e:
        raise SourceError(f"{path}: cannot read: {e}") from e
    return False


def _json_array_records(path: Path, source: str) -> Iterator[RawRecord]:
    """Elements of a top-level JSON array, each with the line it starts on, as one-line raw records.

    Invalid UTF-8 survives decoding as surrogate escapes and is re-encoded to the original bytes, so that
    element is rejected on its own. A syntax error breaks record boundaries: the whole source fails.
    """
    with _open_binary(path) as f:
        text = f.read().removeprefix(_BOM).decode("utf-8", "surrogateescape")
    decoder = json.JSONDecoder()
    pos = _skip_space(text, text.index("[") + 1)
    line = 1 + text.count("\n", 0, pos)
    while _char(text, pos, source) != "]":
        try:
            _, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise SourceError(f"{source}:{e.lineno}: not a valid JSON array: {e.msg}") from e
        # A raw line break cannot occur inside a JSON string, so joining lines keeps the element's meaning.
        element = text[pos:end].replace("\r", " ").replace("\n", " ")
        yield RawRecord(source, line, element.encode("utf-8", "surrogateescape"))
        nxt = _skip_space(text, end)
        if _char(text, nxt, source) == ",":
            nxt = _skip_space(text, nxt + 1)
        elif _char(text, nxt, source) != "]":
            line += text.count("\n", pos, nxt)
            raise SourceError(f"{source}:{line}: expected ',' or ']' after an element of the JSON array")
        line += text.count("\n", pos, nxt)
        pos = nxt


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _char(text: str, pos: int, source: str) -> str:
    if pos >= len(text):
        raise SourceError(f"{source}: the JSON array ends before its closing ']'")
    return text[pos]


def _parquet_records(path: Path, source: str) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield RawRecord(source, n, _row_bytes(row))


def _dataset_records(source: str, split: str) -> Iterator[RawRecord]:
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # datasets raises many types (not found, offline, bad config): all mean the same
        raise SourceError(f"{source}: not a file, and `datasets` cannot load it: {e}") from e
    for n, row in enumerate(ds, 1):
        yield RawRecord(source, n, _row_bytes(row))


def _row_bytes(row: dict) -> bytes:
    return json.dumps(row, ensure_ascii=False, default=str).encode("utf-8")


# ------------------------------------------------------------------------------------------- validating


def parse_record(record: RawRecord, require_answers: bool = True) -> Conversation:
    """Validate and normalise one record to OpenAI-style messages with roles system/user/assistant.

    `require_answers=False` (regeneration) accepts missing or empty assistant turns: the target writes them.
    """
    if record.oversize:
        raise ConversationError(
            "too_large", f"{record.oversize} bytes, over the record size limit (max_record_bytes); not read"
        )
    return parse_object(_decode(record.raw), record, require_answers)


def parse_object(obj: object, record: RawRecord, require_answers: bool = True) -> Conversation:
    """`parse_record` of a record already decoded from JSON; `record` names where it came from."""
    if not isinstance(obj, dict):
        raise ConversationError("bad_structure", f"expected a JSON object, got {type(obj).__name__}")
    if "messages" not in obj and "conversations" not in obj and ("prompt" in obj or "text" in obj):
        return _plain_record(obj, record, require_answers)
    turns = obj.get("messages") or obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ConversationError("bad_structure", "no non-empty 'messages' or 'conversations' list")
    messages = [_message(turn, i) for i, turn in enumerate(turns)]
    system = obj.get("system")  # some ShareGPT exports keep the system prompt beside the turns
    if isinstance(system, str) and system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    opening = next((m for m in messages if m["role"] != "system"), None)
    if opening is not None and opening["role"] == "assistant":
        raise ConversationError(
            "assistant_first", "the conversation opens with an assistant turn: no request for it to answer"
        )
    if require_answers:
        _check_answers(messages)
    mode = obj.get("enable_thinking")
    if mode is not None and not isinstance(mode, bool):
        raise ConversationError("bad_structure", f"enable_thinking must be true or false, not {mode!r}")
    return Conversation(_record_id(obj.get("id"), record), messages, record.where, mode)


def _plain_record(obj: dict, record: RawRecord, require_answers: bool) -> Conversation:
    """A {"prompt", "completion"} or {"text"} record (not both forms)."""
    if "prompt" in obj and "text" in obj:  # fmt: skip
        raise ConversationError(
            "bad_structure", "a record has `prompt` and `completion`, or `text`: not both"
        )
    kind = PROMPT if "prompt" in obj else TEXT
    fields = ("prompt", "completion") if kind == PROMPT else ("text",)
    values = []
    for i, name in enumerate(fields):
        value = obj.get(name, "")
        if not isinstance(value, str):
            raise ConversationError("non_string_content", f"`{name}` is {type(value).__name__}, not a string")
        _check_encodable(value, i)
        values.append(value)
    trained = values[-1]
    if kind == TEXT and not trained.strip():
        raise ConversationError("empty_assistant", "empty `text`")
    if kind == PROMPT and require_answers and not trained.strip():
        raise ConversationError("empty_assistant", "no `completion` to train on (regenerate writes one)")
    if kind == PROMPT and not require_answers and not values[0].strip():
        raise ConversationError("bad_structure", "empty `prompt`: nothing to continue")
    messages = [{"role": "user", "content": values[0]}] if kind == PROMPT else []
    messages.append({"role": "assistant", "content": trained})
    return Conversation(_record_id(obj.get("id"), record), messages, record.where, None, kind)


def _decode(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConversationError("invalid_utf8", f"invalid UTF-8 at byte {e.start}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConversationError("malformed_json", f"not valid JSON: {e.msg} at column {e.colno}") from e
    except RecursionError:
        raise ConversationError("malformed_json", "nested too deeply to read") from None


def _message(turn: object, i: int) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise ConversationError("bad_structure", f"turn {i} is a {type(turn).__name__}, not an object")
    role = turn.get("role", turn.get("from"))
    tool_role = isinstance(role, str) and role.lower() in _TOOL_ROLES
    if tool_role or turn.get("tool_calls") or turn.get("function_call"):
        raise ConversationError(
            "tool_turn", f"turn {i}: a tool call or tool result; conversations with tools are not trained on"
        )
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise ConversationError("unknown_role", f"turn {i}: unknown role {role!r}")
    role = ROLE_ALIASES[role.lower()]
    content = turn["content"] if "content" in turn else turn.get("value")
    if isinstance(content, list):  # OpenAI's list of content parts: its text parts, in order
        content = _text_of_parts(content, i, role)
    if not isinstance(content, str):
        raise ConversationError(
            "non_string_content", f"turn {i} ({role}): content is {type(content).__name__}, not a string"
        )
    _check_encodable(content, i)
    reasoning = turn.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        content = with_reasoning(content, reasoning)
    return {"role": role, "content": content}


def _text_of_parts(parts: list, i: int, role: str) -> str:
    if not all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts
    ):
        kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in parts})
        raise ConversationError("non_text_content", f"turn {i} ({role}): content parts of kinds {kinds}")
    return "".join(p["text"] for p in parts)


def _check_encodable(content: str, i: int) -> None:
    """JSON escapes can smuggle lone surrogates into a valid line; they are not UTF-8 text either."""
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConversationError("invalid_utf8", f"turn {i}: lone surrogate at character {e.start}") from e


def _check_answers(messages: list[dict[str, str]]) -> None:
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        raise ConversationError("missing_assistant", "no assistant turn")
    for i in answers:
        if not messages[i]["content"].strip():
            raise ConversationError("empty_assistant", f"turn {i}: empty assistant turn")


def _record_id(value: object, record: RawRecord) -> str:
    if value is None:
        return record.default_id
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConversationError("bad_id", f"id must be a string or an integer, got {value!r}")
    return str(value)
