"""Drafter variants compared by served tau at equal tokens (flashdraft.compare, `flashdraft compare`)."""

import json

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from flashdraft.cli.main import app
from flashdraft.compare import Comparison, open_comparison, parse_variant, print_comparison
from flashdraft.eval.spec import decoding_target, encode_prompt, run_methods
from flashdraft.model.checkpoint import latest_checkpoint, load_drafter
from flashdraft.model.target import load_target, stop_token_ids

PROMPTS = {
    "code": [[{"role": "user", "content": "def add(a, b):"}], [{"role": "user", "content": "import os\n"}]],
    "chat": [[{"role": "user", "content": "Say hello."}]],
}
BASE = {
    "data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "drafter.num_layers": 1,
    "drafter.num_taps": 2, "drafter.block_size": 8, "log_every": 2, "optim.warmup_ratio": 0.2, "epochs": 4,
}  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(token_data_dir):
    return token_data_dir


def _jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def _comparison(target, data, **over):
    fields = dict(
        target=str(target), data=str(data), base=BASE, steps=4, prompts=PROMPTS, max_new_tokens=12,
        device="cpu", variants={"today": {}, "gamma": {"position_weights": "gamma"}},
    )  # fmt: skip
    return Comparison(**(fields | over))


def test_a_variant_is_a_name_and_its_settings():
    assert parse_variant("today") == ("today", {})
    sliding = "sliding:drafter.layer_types=[sliding_attention, full_attention],drafter.sliding_window=64"
    assert parse_variant(sliding) == (
        "sliding",
        {"drafter.layer_types": ["sliding_attention", "full_attention"], "drafter.sliding_window": 64},
    )
    assert parse_variant("mix:distill=0.5,drafter.num_layers=6") == (
        "mix",
        {"distill": 0.5, "drafter.num_layers": 6},
    )
    with pytest.raises(ValueError, match="expected NAME:KEY=VALUE"):
        parse_variant("mix:distill")


def test_a_comparison_is_checked_before_it_starts_and_cannot_change(tiny_target_dir, data_dir, tmp_path):
    with pytest.raises(ValueError, match="(?s)variant 'bad'.*position_weights"):
        open_comparison(
            tmp_path / "a",
            _comparison(tiny_target_dir, data_dir, variants={"bad": {"position_weights": "x"}}),
        )
    for taken in ("ngram", "plain"):
        with pytest.raises(ValueError, match=f"variant name '{taken}'"):
            open_comparison(tmp_path / taken, _comparison(tiny_target_dir, data_dir, variants={taken: {}}))
    cmp = open_comparison(tmp_path / "c", _comparison(tiny_target_dir, data_dir))
    assert open_comparison(tmp_path / "c", None) == cmp == open_comparison(tmp_path / "c", cmp)
    with pytest.raises(ValueError, match="holds another comparison"):
        open_comparison(tmp_path / "c", _comparison(tiny_target_dir, data_dir, steps=5))


@pytest.mark.slow
def test_variants_train_equal_tokens_and_their_served_tau_is_compared(tiny_target_dir, data_dir, tmp_path):
    """`flashdraft compare` run to the end: it trains, decodes and prints the table it writes."""
    out = tmp_path / "cmp"
    args = ["compare", "--out", str(out), "--target", str(tiny_target_dir), "--data", str(data_dir),
            "--steps", "4", "--max-new-tokens", "12", "--device", "cpu",
            "--variant", "today", "--variant", "gamma:position_weights=gamma", "--plain"]  # fmt: skip
    args += [a for key, value in BASE.items() for a in ("--base", f"{key}={value}")]
    for name, conversations in PROMPTS.items():
        args += ["--prompts", f"{name}={_jsonl(tmp_path / f'{name}.jsonl', conversations)}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert open_comparison(out, None) == _comparison(tiny_target_dir, data_dir, plain=True)
    table = json.loads((out / "table.json").read_text())
    assert "served tau at 4 steps each" in result.output
    # every variant trained the same steps on the same micro-batches, and differently
    training = table["training"]
    assert {t["steps"] for t in training.values()} == {4} and training["today"]["tokens"] > 0
    assert training["today"]["tokens"] == training["gamma"]["tokens"]
    a, b = (latest_checkpoint(out / n / "run" / "checkpoints") for n in ("today", "gamma"))
    assert a.name == b.name == "step_000004"
    saved = {n: yaml.safe_load((out / n / "run" / "config.yaml").read_text()) for n in ("today", "gamma")}
    assert (saved["today"]["position_weights"], saved["gamma"]["position_weights"]) == ("dpace", "gamma")
    wa, wb = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert not all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = {(r["set"], r["temperature"], r["variant"]): r for r in table["rows"]}
    assert len(rows) == 2 * 2 * 2
    for (s, t, name), r in rows.items():
        assert r["vs_reference"]["ratio"] == (
            1.0 if name == "today" else r["tau"] / rows[s, t, "today"]["tau"]
        )
        plain, mine = (json.loads((out / w / f"{s}_t{t:g}.json").read_text()) for w in ("plain", name))
        tpot = "time_per_output_token_s"
        assert r["speedup"] == pytest.approx(plain[tpot] / mine[tpot], abs=1e-3)
    assert "speedup" in result.output
    # each variant's tau is what a plain eval of its checkpoint gives with every method running
    model, tokenizer = load_target(tiny_target_dir, "cpu")
    drafter = load_drafter(b, "cpu").eval()
    ids = [encode_prompt(tokenizer, c) for c in PROMPTS["code"]]
    for t in (0.0, 1.0):
        full = run_methods(
            decoding_target(model, drafter), drafter, ids, 12, 8, t, stop_token_ids(model, tokenizer)
        )
        for who, method in (("gamma", "dflash"), ("ngram", "ngram"), ("plain", "autoregressive")):
            report = json.loads((out / who / f"code_t{t:g}.json").read_text())
            assert report["outputs"] == [g.tokens for g in full[method]]  # the same samples at T = 1
            assert report["tau_per_sample"] == pytest.approx([g.tau for g in full[method]])


def test_the_command_writes_the_comparison_it_names(tiny_target_dir, data_dir, tmp_path):
    """`flashdraft compare`'s options reach the saved comparison (a run with no time left trains nothing
    and says the same command continues it)."""
    prompts = _jsonl(tmp_path / "p.jsonl", PROMPTS["code"])
    out = tmp_path / "cmp"
    args = ["compare", "--out", str(out), "--target", str(tiny_target_dir), "--data", str(data_dir),
            "--prompts", f"code={prompts}", "--humaneval", "2", "--base", "drafter.num_layers=1",
            "--steps", "3", "--variant", "today", "--variant", "mix:distill=0.5,drafter.num_taps=2",
            "--max-new-tokens", "9", "--no-ngram", "--device", "cpu", "--minutes", "0"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "the same command continues the training" in result.output
    cmp = open_comparison(out, None)
    assert cmp.variants == {"today": {}, "mix": {"distill": 0.5, "drafter.num_taps": 2}}
    assert (cmp.steps, cmp.max_new_tokens, cmp.ngram, cmp.base) == (3, 9, False, {"drafter.num_layers": 1})
    assert list(cmp.prompts) == ["code", "humaneval"] and cmp.prompts["code"] == PROMPTS["code"]
    assert len(cmp.prompts["humaneval"]) == 2 and cmp.decoders == ("today", "mix") and not cmp.plain
    # run again with only --out: the same comparison continues
    again = CliRunner().invoke(app, ["compare", "--out", str(out), "--minutes", "0"])
    assert again.exit_code == 0 and open_comparison(out, None) == cmp, again.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--variant", "mix:distill"], "--variant 'mix:distill': expected NAME:KEY=VALUE"),
        (["--variant", "a", "--variant", "a"], "--variant names must differ: 'a' is given twice"),
        (["--variant", "a", "--base", "layers"], "--base 'layers': expected KEY=VALUE"),
        (["--variant", "a", "--prompts", "code.jsonl"], "--prompts 'code.jsonl': expected NAME=JSONL"),
        (["--variant", "a", "--variant", "b:position_weights=x"], "variant 'b'"),
        ([], "does not exist: name what to compare"),
    ],
)
def test_the_command_refuses_a_comparison_it_cannot_run(args, message, tiny_target_dir, data_dir, tmp_path):
    """Bad options fail before anything trains, with exit status 2 and a message naming the option."""
    prompts = _jsonl(tmp_path / "p.jsonl", PROMPTS["chat"])
    given = ["--target", str(tiny_target_dir), "--data", str(data_dir), "--steps", "2"]
    given += [] if "--prompts" in args else ["--prompts", f"chat={prompts}"]
    result = CliRunner().invoke(app, ["compare", "--out", str(tmp_path / "cmp"), *given, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "error:" in result.output
    assert not (tmp_path / "cmp").exists()


def test_the_table_prints_with_one_prompt_a_set():
    """One prompt has no standard error: the table prints tau alone (it raised a TypeError)."""
    row = {"set": "code", "temperature": 0.0, "variant": "today", "tau": 1.5, "tau_stderr": None,
           "vs_reference": {"ratio": 1.0, "ci95": [1.0, 1.0], "samples": 1},
           "acceptance_1_3": [0.5, None, None], "ngram_tau": None}  # fmt: skip
    table = {"steps": 3, "reference": "today", "rows": [row], "training": {}}
    console = Console(record=True, width=120)
    print_comparison(table, console)
    assert "│ 1.50 │" in console.export_text()
