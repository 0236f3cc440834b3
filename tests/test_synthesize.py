"""`flashdraft data synthesize` (Magpie): user turns sampled from the chat template's user header, kept or
dropped with a reason, deduplicated, resumable, and fed to `data regenerate` and `data prepare` as they are.

The tiny target's lm_head gets a bias towards <|im_end|> (and a smaller one towards <|im_start|>), so that
its turns end within a few tokens and some run into a template token, as an aligned model's do."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from flashdraft.cli.main import app
from flashdraft.data.synthesize import (
    REASONS,
    SynthesisOptions,
    classify,
    rejected_path_for,
    synthesize,
    user_turn_frame,
)


def _biased(target_dir, **bias: float):
    """(model, tokenizer): the tiny target with its lm_head biased towards some tokens."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    logits = torch.zeros(model.config.vocab_size)
    for token, value in bias.items():
        (i,) = tok.convert_tokens_to_ids([token])
        assert i is not None and i != tok.unk_token_id, token
        logits[i] = value
    model.lm_head.bias = torch.nn.Parameter(logits)
    return model, tok


@pytest.fixture(scope="module")
def chatty(tiny_target_dir):
    """Ends a turn within a few tokens, and now and then opens a new one first."""
    return _biased(tiny_target_dir, **{"<|im_end|>": 4.0, "<|im_start|>": 2.0})


def test_the_user_turn_frame_is_read_from_the_chat_template(tiny_tokenizer):
    prefix, end_ids = user_turn_frame(tiny_tokenizer)
    assert prefix == "<|im_start|>user\n"
    assert end_ids == [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    steered, _ = user_turn_frame(tiny_tokenizer, system="You write Python.")
    assert steered == "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\n"
    tok = copy.deepcopy(tiny_tokenizer)  # as transformers 5.17 converts SmolLM2's GGUF: the template's
    tok.eos_token, tok.extra_special_tokens, tok.mask_token = "<|endoftext|>", [], None  # tokens unnamed
    end, eos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.all_special_ids == [eos]
    assert user_turn_frame(tok) == (prefix, sorted([end, eos]))
    tok = copy.deepcopy(tiny_tokenizer)  # a template that ends a user turn with text: nothing to stop at
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="not a special token"):
        user_turn_frame(tok)


def test_a_sample_is_kept_or_dropped_for_a_reason(tiny_tokenizer):
    tok = tiny_tokenizer
    end, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    words = tok("sort a list", add_special_tokens=False).input_ids
    special = {start}
    assert classify([*words, end, 0, 0], [end], special, tok) == ("sort a list", None)
    assert classify(words, [end], special, tok) == ("sort a list", "no_end")
    assert classify([*words, start, end], [end], special, tok)[1] == "template_tokens"
    assert (
        classify(tok(" \n ", add_special_tokens=False).input_ids + [end], [end], special, tok)[1] == "empty"
    )


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kept_turns_are_distinct_user_turns_and_every_drop_has_its_reason(chatty, tmp_path):
    model, tok = chatty
    out = tmp_path / "prompts.jsonl"
    summary = synthesize(model, tok, out, SynthesisOptions(count=6, max_tokens=12, batch_size=8))
    kept, dropped = _lines(out), _lines(rejected_path_for(out))
    assert summary.kept == len(kept) == 6
    assert len({k["messages"][0]["content"].casefold() for k in kept}) == 6
    assert all(k["messages"][0]["role"] == "user" and k["messages"][0]["content"].strip() for k in kept)
    assert sum(summary.rejected.values()) == len(dropped) and {d["reason"] for d in dropped} <= set(REASONS)
    assert summary.rejected["template_tokens"] > 0  # the biased <|im_start|> shows up before some ends
    assert summary.samples == len(kept) + len(dropped)


def test_turns_are_sampled_as_the_options_say_whatever_the_model_recommends(tiny_target_dir, tmp_path):
    """A checkpoint's generation_config (a top-k, a repetition penalty) does not reach the sampling: a
    parrot's turns ("de", "dede", ...) come out the same with a penalty on repeats in its config."""
    options = SynthesisOptions(count=8, max_tokens=8, batch_size=8, max_samples=16)
    kept = []
    for recommended in ({}, {"top_k": 2, "repetition_penalty": 5.0}):
        model, tok = _biased(tiny_target_dir, **{"de": 8.0, "<|im_end|>": 7.0})
        model.generation_config.update(**recommended)
        out = tmp_path / f"{len(kept)}.jsonl"
        synthesize(model, tok, out, options)
        kept.append(_lines(out) + _lines(rejected_path_for(out)))
    assert kept[0] == kept[1] and any("dede" in json.dumps(k) for k in kept[0])


def test_a_turn_said_twice_is_kept_once(tiny_target_dir, tmp_path):
    """A parrot: each token is "de" or the end of the turn, about even, so its turns are "de", "dede",
    ... and repeat."""
    model, tok = _biased(tiny_target_dir, **{"de": 8.0, "<|im_end|>": 8.0})
    out = tmp_path / "prompts.jsonl"
    summary = synthesize(
        model, tok, out, SynthesisOptions(count=20, max_tokens=6, batch_size=8, max_samples=16)
    )
    kept = [k["messages"][0]["content"] for k in _lines(out)]
    assert len(set(kept)) == len(kept) == summary.kept < 16  # fewer distinct turns than samples
    duplicates = [d["text"] for d in _lines(rejected_path_for(out)) if d["reason"] == "duplicate"]
    assert summary.rejected["duplicate"] == len(duplicates) > 0 and set(duplicates) <= set(kept)


def test_a_killed_run_resumes_to_the_uninterrupted_result(chatty, tmp_path):
    model, tok = chatty
    options = SynthesisOptions(count=10, max_tokens=12, batch_size=8)
    whole = tmp_path / "whole.jsonl"
    synthesize(model, tok, whole, options)
    cut = tmp_path / "cut.jsonl"
    synthesize(model, tok, cut, SynthesisOptions(count=5, max_tokens=12, batch_size=8))  # stopped early
    for path in (cut, rejected_path_for(cut)):  # and killed while writing: the last line torn
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:-1]) + lines[-1][:7])
    summary = synthesize(model, tok, cut, options)
    assert summary.already == 4
    assert _lines(cut) == _lines(whole)
    rejected = lambda p: sorted(map(json.dumps, _lines(rejected_path_for(p))))  # noqa: E731
    assert rejected(cut) == rejected(whole)
    with pytest.raises(ValueError, match="seed 0 -> 1. Rerun with the recorded settings"):
        synthesize(model, tok, cut, SynthesisOptions(count=10, max_tokens=12, batch_size=8, seed=1))


def test_synthesized_turns_feed_regenerate_and_prepare_as_they_are(chatty, tiny_target_dir, tmp_path):
    model, tok = chatty
    out = tmp_path / "prompts.jsonl"
    synthesize(model, tok, out, SynthesisOptions(count=4, max_tokens=12, batch_size=8))
    runner = CliRunner()
    regen = tmp_path / "regen.jsonl"
    result = runner.invoke(app, ["data", "regenerate", "--target", str(tiny_target_dir), "--input", str(out),
                                 "--out", str(regen), "--backend", "local", "--max-tokens", "8",
                                 "--device", "cpu", "--no-progress"])  # fmt: skip
    assert result.exit_code == 0, result.output
    answered = _lines(regen)
    assert [r["id"] for r in answered] == [r["id"] for r in _lines(out)]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in answered)
    result = runner.invoke(app, ["data", "prepare", "--target", str(tiny_target_dir), "--input", str(regen),
                                 "--out", str(tmp_path / "data")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "data" / "stats.json").read_text())["kept"] == 4


def test_the_command_says_how_many_turns_it_kept_and_fails_short_of_the_count(tiny_target_dir, tmp_path):
    """The unbiased tiny target almost never ends a turn within 4 tokens."""
    out = tmp_path / "prompts.jsonl"
    args = ["data", "synthesize", "--target", str(tiny_target_dir), "--out", str(out), "--count", "2",
            "--max-tokens", "4", "--batch-size", "4", "--max-samples", "8", "--device", "cpu",
            "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert "this run sampled 8" in result.output and "of 2 user turns kept after 8 samples" in result.output
