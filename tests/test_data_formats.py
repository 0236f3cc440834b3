"""Input formats: OpenAI and ShareGPT records from JSONL, JSON arrays, Parquet and datasets; bad records."""

import json

import pytest

from flashdraft.data.formats import (
    ConversationError,
    RawRecord,
    SourceError,
    count_records,
    iter_raw_records,
    parse_record,
)

OPENAI = {
    "id": "a1",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ],
}
SHAREGPT = {
    "id": "s1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello."},
    ],
}


def record(obj, line: int = 1, source: str = "data/in.jsonl") -> RawRecord:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return RawRecord(source, line, raw)


def test_openai_record_round_trips():
    conv = parse_record(record(OPENAI))
    assert conv.to_json() == OPENAI
    assert parse_record(record(conv.to_json())) == conv


def test_sharegpt_record_reads_as_the_same_openai_conversation():
    conv = parse_record(record(SHAREGPT))
    assert conv.to_json() == {**OPENAI, "id": "s1"}
    assert parse_record(record(conv.to_json())).to_json() == conv.to_json()


def test_sharegpt_top_level_system_prompt_becomes_the_first_message():
    obj = {"system": "S", "conversations": SHAREGPT["conversations"][1:]}
    assert parse_record(record(obj)).messages[0] == {"role": "system", "content": "S"}


def test_separate_reasoning_is_folded_into_the_content_as_a_think_block():
    obj = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "A", "reasoning_content": "R"},
        ]
    }
    assert parse_record(record(obj)).messages[1]["content"] == "<think>\nR\n</think>\n\nA"


def test_missing_id_comes_from_the_file_name_and_line_and_integer_ids_become_strings():
    no_id = {k: v for k, v in OPENAI.items() if k != "id"}
    assert parse_record(record(no_id, line=7, source="some/dir/in.jsonl")).id == "in.jsonl:7"
    assert parse_record(record({**OPENAI, "id": 42})).id == "42"


QA = (("user", "q"), ("assistant", "a"))


def line(*turns, **extra) -> bytes:
    """A JSONL line of an OpenAI-style record with these (role, content) turns."""
    return json.dumps({**extra, "messages": [{"role": r, "content": c} for r, c in turns]}).encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"messages": [', "malformed_json"),
        (line(("user", "caf\u00e9"), ("assistant", "a")).replace(b"\\u00e9", b"\xe9"), "invalid_utf8"),
        (line(("user", "x"), ("assistant", "a")).replace(b'"x"', b'"\\ud800"'), "invalid_utf8"),
        (b"[1, 2]", "bad_structure"),
        (b'{"title": "no turns"}', "bad_structure"),
        (b'{"messages": ["hello"]}', "bad_structure"),
        (line(*QA, id=[1]), "bad_id"),
        (line(("wizard", "q"), ("assistant", "a")), "unknown_role"),
        (line(*QA).replace(b'"role": "user", ', b""), "unknown_role"),
        (line(("user", [{"type": "text"}]), ("assistant", "a")), "non_text_content"),
        (line(("user", "q"), ("assistant", None)), "non_string_content"),
        (line(("user", "q")), "missing_assistant"),
        (line(("user", "q"), ("assistant", "  \n")), "empty_assistant"),
    ],
)
def test_bad_record_is_rejected_with_its_reason(raw, reason):
    with pytest.raises(ConversationError) as e:
        parse_record(record(raw))
    assert e.value.reason == reason


def test_regeneration_accepts_prompts_without_answers():
    prompt_only = {"messages": [{"role": "user", "content": "q"}]}
    assert parse_record(record(prompt_only), require_answers=False).messages == prompt_only["messages"]


def test_jsonl_records_keep_their_line_numbers_and_raw_bytes(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n{"b": 2}\r\nnot json\n')
    records = list(iter_raw_records(str(path)))
    assert [(r.line, r.raw) for r in records] == [(1, b'{"a": 1}'), (4, b'{"b": 2}'), (5, b"not json")]
    assert records[2].where == f"{path}:5"
    assert count_records(str(path)) == 3


def test_json_array_elements_get_the_line_they_start_on(tmp_path):
    path = tmp_path / "in.json"
    path.write_text('[\n  {"id": "x",\n   "messages": []},\n\n  {"id": "y"}\n]\n')
    records = list(iter_raw_records(str(path)))
    assert [r.line for r in records] == [2, 5]
    assert json.loads(records[0].raw) == {"id": "x", "messages": []}
    assert b"\n" not in records[0].raw


def test_invalid_utf8_in_a_json_array_rejects_only_that_element(tmp_path):
    path = tmp_path / "in.json"
    path.write_bytes(b'[{"id": "ok", "v": "fine"},\n {"id": "bad", "v": "caf\xe9"}]')
    good, bad = iter_raw_records(str(path))
    assert json.loads(good.raw)["id"] == "ok"
    assert bad.line == 2 and b"caf\xe9" in bad.raw
    with pytest.raises(ConversationError, match="UTF-8") as e:
        parse_record(bad)
    assert e.value.reason == "invalid_utf8"


def test_broken_json_array_is_a_source_error_with_its_line(tmp_path):
    path = tmp_path / "in.json"
    path.write_text('[{"id": 1},\n {"id": 2,,}]')
    with pytest.raises(SourceError, match=r"in\.json:2"):
        list(iter_raw_records(str(path)))


def test_parquet_rows_read_as_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([OPENAI, {**OPENAI, "id": "a2"}]), path)
    records = list(iter_raw_records(str(path)))
    assert [r.line for r in records] == [1, 2]
    assert [parse_record(r).to_json() for r in records] == [OPENAI, {**OPENAI, "id": "a2"}]
    assert count_records(str(path)) == 2


def test_a_local_dataset_folder_loads_through_datasets(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps(SHAREGPT) + "\n")
    (conv,) = [parse_record(r) for r in iter_raw_records(str(tmp_path / "data"))]
    assert conv.to_json() == {**OPENAI, "id": "s1"}


def test_a_missing_file_fails_at_once_without_asking_the_hub(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        list(iter_raw_records(str(tmp_path / "absent.jsonl")))
