"""`flashdraft data prepare`: shards training can load, stats, and every bad record reported and kept."""

import json

import pytest
from typer.testing import CliRunner

import flashdraft.data.prepare as prepare_module
from flashdraft.cli.data import data_app
from flashdraft.data.packing import load_token_dataset
from flashdraft.data.prepare import (
    SHOWN_REJECTS,
    PrepareOptions,
    StrictStop,
    prepare_dataset,
    prepare_records,
)
from flashdraft.data.tokenize import tokenize_conversation


def line(*turns, **extra) -> bytes:
    """A JSONL line of an OpenAI-style record with these (role, content) turns."""
    return json.dumps({**extra, "messages": [{"role": r, "content": c} for r, c in turns]}).encode()


def chat(i: int, answer: str | None = None) -> dict:
    return json.loads(line(("user", f"Question {i}?"), ("assistant", answer or f"Answer {i}."), id=f"c{i}"))


def sharegpt(i: int) -> dict:
    return {
        "id": f"s{i}",
        "conversations": [{"from": "human", "value": f"Hi {i}"}, {"from": "gpt", "value": "Hello."}],
    }


# Each bad line of the mixed input, with the reason it must be rejected for.
BAD_LINES = [
    (b'{"messages": [{"role": "user", "content": "q"}', "malformed_json"),
    (line(("wizard", "q"), ("assistant", "a")), "unknown_role"),
    (line(("user", "q"), ("assistant", "")), "empty_assistant"),
    (line(("user", "q")), "missing_assistant"),
    (line(("user", 7), ("assistant", "a")), "non_string_content"),
    (line(("user", "caf\u00e9"), ("assistant", "a")).replace(b"\\u00e9", b"\xe9"), "invalid_utf8"),
    (
        line(("user", "word " * 400), ("assistant", "ok"), id="long"),
        "no_loss_tokens",
    ),  # nothing left at MAX_LENGTH
]
MAX_LENGTH = 200


@pytest.fixture
def mixed_input(tmp_path):
    """Good OpenAI and ShareGPT lines with every kind of bad line between them; returns (path, bad lines)."""
    good = [json.dumps(chat(0)).encode(), json.dumps(sharegpt(1)).encode(), json.dumps(chat(2)).encode()]
    lines = [good[0], BAD_LINES[0][0], good[1], *[raw for raw, _ in BAD_LINES[1:]], good[2]]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    bad_at = {lines.index(raw) + 1: (raw, reason) for raw, reason in BAD_LINES}
    return path, bad_at


def run_prepare(tokenizer, source, out, **options) -> tuple[dict, list[str]]:
    messages: list[str] = []
    stats = prepare_dataset(
        str(source), tokenizer, out, PrepareOptions(cache_dir=out / "cache", **options), messages.append
    )
    return stats, messages


def test_every_bad_record_is_reported_counted_and_copied_verbatim(tiny_tokenizer, mixed_input, tmp_path):
    path, bad_at = mixed_input
    stats, messages = run_prepare(tiny_tokenizer, path, tmp_path / "out", max_length=MAX_LENGTH)

    assert len(messages) == len(BAD_LINES)
    for line, (_, reason) in bad_at.items():
        assert any(m.startswith(f"{path}:{line}: {reason}: ") for m in messages), (line, reason)
    rejected = (tmp_path / "out" / "rejected.jsonl").read_bytes().split(b"\n")
    assert rejected[-1] == b"" and sorted(rejected[:-1]) == sorted(raw for raw, _ in BAD_LINES)
    assert stats["records_read"] == 3 + len(BAD_LINES)
    assert stats["kept"] == 3 and stats["rejected"] == len(BAD_LINES)
    assert {r: n for r, n in stats["rejected_by_reason"].items() if n} == {
        reason: 1 for _, reason in BAD_LINES
    }
    assert json.loads((tmp_path / "out" / "stats.json").read_text()) == stats
    assert list(stats["seconds"]) == ["validate", "tokenize", "keep", "save"]  # where the time went
    assert all(s >= 0 for s in stats["seconds"].values())


def test_shards_hold_the_tokenized_conversations_and_stats_count_them(tiny_tokenizer, mixed_input, tmp_path):
    path, _ = mixed_input
    stats, _ = run_prepare(tiny_tokenizer, path, tmp_path / "out", max_length=MAX_LENGTH)
    ds = load_token_dataset(tmp_path / "out")
    assert ds["id"] == ["c0", "s1", "c2"]
    hello = [{"role": "user", "content": "Hi 1"}, {"role": "assistant", "content": "Hello."}]
    expected = [chat(0)["messages"], hello, chat(2)["messages"]]
    for row, messages in zip(ds, expected, strict=True):
        assert (row["input_ids"], row["loss_mask"]) == tokenize_conversation(tiny_tokenizer, messages)
    assert ds["length"] == [len(x) for x in ds["input_ids"]]
    assert stats["tokens"] == sum(len(x) for x in ds["input_ids"])
    assert stats["loss_tokens"] == sum(sum(x) for x in ds["loss_mask"])
    assert stats["length_histogram"] == {"1-128": 3}


def test_strict_stops_at_the_first_bad_record(tiny_tokenizer, mixed_input, tmp_path):
    path, bad_at = mixed_input
    first_line, (first_raw, reason) = min(bad_at.items())
    with pytest.raises(StrictStop, match=f"{path}:{first_line}: {reason}"):
        run_prepare(tiny_tokenizer, path, tmp_path / "out", strict=True)
    assert (tmp_path / "out" / "rejected.stopped.jsonl").read_bytes() == first_raw + b"\n"
    assert not (tmp_path / "out" / "shards").exists() and not (tmp_path / "out" / "rejected.jsonl").exists()


def test_long_conversations_are_truncated_or_dropped(tiny_tokenizer, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(chat(i, "A long answer. " * 30)) for i in range(4)) + "\n")
    full = len(tokenize_conversation(tiny_tokenizer, chat(0, "A long answer. " * 30)["messages"])[0])
    cut, _ = run_prepare(tiny_tokenizer, path, tmp_path / "cut", max_length=full - 10)
    assert cut["kept"] == 4 and cut["truncated"] == 4
    assert max(len(x) for x in load_token_dataset(tmp_path / "cut")["input_ids"]) == full - 10
    dropped, messages = run_prepare(
        tiny_tokenizer, path, tmp_path / "drop", max_length=full - 10, drop_long=True
    )
    assert dropped["kept"] == 0 and dropped["rejected_by_reason"]["too_long"] == 4
    assert messages[0] == f"{path}:1: too_long: {full} tokens > max length {full - 10}"
    assert len(load_token_dataset(tmp_path / "drop")) == 0


def test_records_in_memory_prepare_like_a_file(tiny_tokenizer, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps(chat(0)) + "\n" + json.dumps(sharegpt(1)) + "\n")
    from_file, _ = run_prepare(tiny_tokenizer, tmp_path / "in.jsonl", tmp_path / "file")
    messages: list[str] = []
    records = [chat(0), sharegpt(1), {"id": "bad", "messages": []}]
    stats = prepare_records(
        records, tiny_tokenizer, tmp_path / "mem", messages.append, cache_dir=tmp_path / "c"
    )
    assert load_token_dataset(tmp_path / "mem").to_list() == load_token_dataset(tmp_path / "file").to_list()
    assert stats["tokens"] == from_file["tokens"] and stats["kept"] == 2
    assert messages == ["<records>:3: bad_structure: no non-empty 'messages' or 'conversations' list"]


def test_json_array_and_parquet_give_the_same_shards_as_jsonl(tiny_tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [chat(0), chat(1)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "in.json").write_text(json.dumps(records, indent=2))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "in.parquet")
    shards = []
    for name in ("in.jsonl", "in.json", "in.parquet"):
        run_prepare(tiny_tokenizer, tmp_path / name, tmp_path / f"out-{name}")
        shards.append(load_token_dataset(tmp_path / f"out-{name}").to_list())
    assert shards[0] == shards[1] == shards[2] and len(shards[0]) == 2


def test_parallel_tokenization_matches_one_process(tiny_tokenizer, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(chat(i, f"Answer {i} " * (i % 5 + 1))) for i in range(600)) + "\n")
    one, _ = run_prepare(tiny_tokenizer, path, tmp_path / "one", num_proc=1)
    two, _ = run_prepare(tiny_tokenizer, path, tmp_path / "two", num_proc=2)
    assert two["kept"] == one["kept"] == 600
    assert load_token_dataset(tmp_path / "two").to_list() == load_token_dataset(tmp_path / "one").to_list()
    assert len(list((tmp_path / "two").rglob("tokenized-*_of_00002.arrow"))) == 2  # two processes ran


def test_forked_tokenization_workers_take_the_tokenizer_without_serializing_it(
    tiny_tokenizer, tmp_path, monkeypatch
):
    """A large tokenizer (Gemma 3's, 28 MB pickled) serialized into each worker's work made 8 processes
    6 times slower than one; forked workers inherit it instead."""
    serialized = []
    cls = type(tiny_tokenizer)
    original = cls.__reduce_ex__

    def counting(self, protocol):
        serialized.append(protocol)
        return original(self, protocol)

    monkeypatch.setattr(cls, "__reduce_ex__", counting)
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(chat(i)) for i in range(600)) + "\n")
    stats, _ = run_prepare(tiny_tokenizer, path, tmp_path / "two", num_proc=2)
    assert stats["kept"] == 600 and len(list((tmp_path / "two").rglob("tokenized-*_of_00002.arrow"))) == 2
    assert serialized == []


def test_preparing_the_same_data_again_reuses_the_tokenization_cache(tiny_tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(chat(i)) for i in range(5)) + "\n")
    options = PrepareOptions(cache_dir=tmp_path / "cache")
    first = prepare_dataset(str(path), tiny_tokenizer, tmp_path / "a", options, lambda _: None)
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return tokenize_conversation(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "tokenize_conversation", counting)
    again = prepare_dataset(str(path), tiny_tokenizer, tmp_path / "b", options, lambda _: None)
    assert calls == [] and again["tokens"] == first["tokens"]
    options.max_length = 1000
    prepare_dataset(str(path), tiny_tokenizer, tmp_path / "c", options, lambda _: None)
    assert len(calls) == 5


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer.save_pretrained(path)
    return path


def test_cli_prepare_writes_shards_and_reports(tokenizer_dir, mixed_input, tmp_path):
    path, bad_at = mixed_input
    out = tmp_path / "out"
    args = ["prepare", "--target", str(tokenizer_dir), "--input", str(path), "--out", str(out)]
    result = CliRunner().invoke(
        data_app, [*args, "--max-length", str(MAX_LENGTH), "--cache-dir", str(tmp_path / "c")]
    )
    assert result.exit_code == 0, result.output
    assert "kept 3 of 10 records" in result.stdout
    for line, (_, reason) in bad_at.items():
        assert f"{path}:{line}: {reason}" in result.stderr
    assert len(load_token_dataset(out)) == 3


def test_prepare_names_the_first_bad_records_and_counts_the_rest(tiny_tokenizer, tmp_path):
    """A dataset of thousands of bad records: 20 named, one line for the rest, every one counted and kept
    in rejected.jsonl."""
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(["{not json"] * 500 + [json.dumps(chat(0))]) + "\n")
    lines = []
    stats = prepare_dataset(str(path), tiny_tokenizer, tmp_path / "out", PrepareOptions(), lines.append)
    assert stats["rejected"] == 500 and stats["kept"] == 1
    assert len((tmp_path / "out" / "rejected.jsonl").read_text().splitlines()) == 500
    assert len(lines) == SHOWN_REJECTS + 1 == 21
    assert lines[SHOWN_REJECTS - 1].startswith(f"{path}:{SHOWN_REJECTS}: ")
    assert f"{path}:{SHOWN_REJECTS + 1}" in lines[-1] and "not named" in lines[-1]


def test_cli_prepare_strict_exits_with_status_2(tokenizer_dir, mixed_input, tmp_path):
    path, _ = mixed_input
    args = [
        "prepare",
        "--target",
        str(tokenizer_dir),
        "--input",
        str(path),
        "--out",
        str(tmp_path / "o"),
        "--strict",
    ]
    result = CliRunner().invoke(data_app, args)
    assert result.exit_code == 2
    assert "--strict" in result.stderr


def test_cli_prepare_of_an_empty_file_says_nothing_was_kept(tokenizer_dir, tmp_path):
    # the proof's validation split is empty when its tiny target answers every prompt with nothing
    (tmp_path / "empty.jsonl").write_text("")
    out = tmp_path / "out"
    args = [
        "prepare",
        "--target",
        str(tokenizer_dir),
        "--input",
        str(tmp_path / "empty.jsonl"),
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(data_app, [*args, "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 1 and "no record was kept" in result.stderr
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["records_read"], stats["kept"]) == (0, 0) and len(load_token_dataset(out)) == 0


def test_cli_prepare_names_the_line_of_a_chat_template_that_does_not_compile(
    tokenizer_dir, mixed_input, tmp_path
):
    """Compiled as transformers compiles it: its `generation` tag is taken, a syntax error is named with its
    line before any record is read, and nothing is written."""
    from test_data_tokenize import QWEN3_TEMPLATE

    bad, good = tmp_path / "bad.jinja", tmp_path / "good.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    answer = "{{- '<|im_start|>assistant\\n' + content }}"
    assert answer in QWEN3_TEMPLATE
    good.write_text(QWEN3_TEMPLATE.replace(answer, "{% generation %}" + answer + "{% endgeneration %}"))
    args = [
        "prepare",
        "--target",
        str(tokenizer_dir),
        "--input",
        str(mixed_input[0]),
        "--cache-dir",
        str(tmp_path),
    ]
    result = CliRunner().invoke(data_app, [*args, "--out", str(tmp_path / "a"), "--chat-template", str(bad)])
    assert result.exit_code == 2 and "bad.jinja:2: not a Jinja template" in result.stderr
    assert not (tmp_path / "a").exists()
    result = CliRunner().invoke(data_app, [*args, "--out", str(tmp_path / "b"), "--chat-template", str(good)])
    assert result.exit_code == 0, result.stderr


def test_cli_prepare_missing_input_exits_with_status_2(tokenizer_dir, tmp_path):
    args = [
        "prepare",
        "--target",
        str(tokenizer_dir),
        "--input",
        str(tmp_path / "nope.jsonl"),
        "--out",
        str(tmp_path),
    ]
    result = CliRunner().invoke(data_app, args)
    assert result.exit_code == 2 and "no such file" in result.stderr


def _outputs(out) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_prepared_dataset_is_never_destroyed_by_a_later_run(tokenizer_dir, mixed_input, tmp_path):
    """A typo in --input, a --strict stop and a second run into the same OUT leave OUT's outputs as they
    were; --overwrite replaces them, even from one of OUT's own files, once the new ones are complete."""
    path, bad_at = mixed_input
    out = tmp_path / "out"
    base = ["prepare", "--target", str(tokenizer_dir), "--out", str(out), "--max-length", str(MAX_LENGTH)]
    assert CliRunner().invoke(data_app, [*base, "--input", str(path)]).exit_code == 0
    before = _outputs(out)
    assert json.loads(before["stats.json"])["rejected"] == len(bad_at) > 0

    again = CliRunner().invoke(data_app, [*base, "--input", str(path)])
    assert (
        again.exit_code == 2 and "holds a prepared dataset" in again.stderr and "--overwrite" in again.stderr
    )
    typo = CliRunner().invoke(data_app, [*base, "--input", str(tmp_path / "typo.jsonl"), "--overwrite"])
    assert typo.exit_code == 2 and "no such file" in typo.stderr
    stop = CliRunner().invoke(data_app, [*base, "--input", str(path), "--overwrite", "--strict"])
    assert stop.exit_code == 2 and "rejected.stopped.jsonl" in stop.stderr
    assert _outputs(out) == before | {"rejected.stopped.jsonl": (out / "rejected.stopped.jsonl").read_bytes()}

    inside = CliRunner().invoke(data_app, [*base, "--input", str(out / "rejected.jsonl")])
    assert inside.exit_code == 2 and "is one of its files" in inside.stderr
    recheck = CliRunner().invoke(data_app, [*base, "--input", str(out / "rejected.jsonl"), "--overwrite"])
    stats = json.loads((out / "stats.json").read_text())
    assert recheck.exit_code == 1 and "no record was kept" in recheck.stderr  # every line was a bad record
    assert stats["records_read"] == len(bad_at) == stats["rejected"] and stats["kept"] == 0
    assert (out / "rejected.jsonl").read_bytes() == before["rejected.jsonl"]  # the same bad records, again
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_each_record_is_rendered_in_its_own_thinking_mode(tiny_tokenizer, tmp_path):
    """Answers regenerated with thinking on and off in one file (`data regenerate` records the mode):
    each is rendered as it was written; a record without a mode takes --thinking's."""
    from test_data_tokenize import QWEN3_TEMPLATE

    records = [chat(0) | {"enable_thinking": True}, chat(1) | {"enable_thinking": False}, chat(2)]
    records.append(chat(3) | {"enable_thinking": "yes"})
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stats, _ = run_prepare(
        tiny_tokenizer, path, tmp_path / "out", enable_thinking=True, chat_template=QWEN3_TEMPLATE
    )
    ds = load_token_dataset(tmp_path / "out")
    assert ds["id"] == ["c0", "c1", "c2"]
    for row, record, mode in zip(ds, records, (True, False, True), strict=False):
        expected = tokenize_conversation(
            tiny_tokenizer, record["messages"], enable_thinking=mode, chat_template=QWEN3_TEMPLATE
        )
        assert (row["input_ids"], row["loss_mask"]) == expected
    off = tokenize_conversation(
        tiny_tokenizer, records[0]["messages"], enable_thinking=False, chat_template=QWEN3_TEMPLATE
    )
    assert ds[0]["loss_mask"] != off[1]  # thinking on trains the think block; off, the prompt supplies it
    assert stats["rejected"] == 1 and stats["rejected_by_reason"]["bad_structure"] == 1
