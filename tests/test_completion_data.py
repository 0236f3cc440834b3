"""Data for a base model: a tiny Gemma 3 whose tokenizer has no chat template (and adds <bos>, as
Gemma's does) gets prompts cut from files and sampled from itself, continued by the target (the loss on
the continuation only), prepared, trained on and evaluated, all through the CLI."""

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

from families import build
from flashdraft.cli.main import app
from flashdraft.data.packing import load_token_dataset
from flashdraft.data.tokenize import prompt_ids
from flashdraft.demo.tiny import save_target, stdlib_files
from flashdraft.eval.spec import encode_prompt
from flashdraft.model.checkpoint import latest_checkpoint
from flashdraft.model.target import load_target

NEW = 10  # tokens a prompt is continued by


def base_tokenizer(chat_tokenizer) -> PreTrainedTokenizerFast:
    """The tests' tokenizer as a base model's: no chat template, <bos> before every text."""
    tok = Tokenizer.from_str(chat_tokenizer.backend_tokenizer.to_str())
    tok.add_special_tokens(["<bos>"])
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        mask_token="<|mask|>",
    )  # fmt: skip


def run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("base")
    tokenizer = base_tokenizer(tiny_tokenizer)
    model = build("gemma3_text", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
    target = save_target(model, tokenizer, root / "target")
    sources = root / "src"
    sources.mkdir()
    for f in stdlib_files(limit=6):
        (sources / f.name).write_text(f.read_text(errors="replace"))
    (sources / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")  # not text: named and skipped
    (sources / "data.bin").write_bytes(b"\x00\x01\x02 = 1\n" * 40)  # valid UTF-8, but binary: skipped too
    return SimpleNamespace(root=root, target=target, sources=sources, tokenizer=load_target(target, "cpu")[1])


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_tokenizer_is_a_base_models(base):
    assert not base.tokenizer.chat_template
    assert prompt_ids(base.tokenizer, "x = 1")[0] == base.tokenizer.bos_token_id


def test_prompts_cut_from_files_continued_prepared_trained_and_evaluated(base):
    root, target = base.root, str(base.target)
    prompts = root / "prompts.jsonl"
    out = run("data", "prompts", "--target", target, "--input", str(base.sources), "--out", str(prompts),
              "--min-tokens", "8", "--max-tokens", "40", "--per-file", "3")  # fmt: skip
    cut = records(prompts)
    assert len(cut) == 18 and "logo.png" in out and "data.bin" in out  # 6 files x 3, the binaries named
    assert len({r["id"] for r in cut}) == len(cut)  # ids name the lines: unique
    for r in cut:
        name, span = r["id"].rsplit(":", 1)
        first, last = map(int, span.split("-"))
        lines = (base.sources / name).read_text().splitlines(keepends=True)
        assert r["prompt"] == "".join(lines[first - 1 : last])  # whole lines of the file
        lines = r["prompt"].splitlines(keepends=True)
        assert 8 <= sum(map(len, base.tokenizer(lines, add_special_tokens=False).input_ids)) <= 40

    regen = root / "regen.jsonl"
    run("data", "regenerate", "--target", target, "--input", str(prompts), "--out", str(regen),
        "--max-tokens", str(NEW), "--device", "cpu", "--no-progress")  # fmt: skip
    answers = records(regen)
    assert [r["id"] for r in answers] == [r["id"] for r in cut] and all("messages" not in r for r in answers)
    model, tokenizer = load_target(target, "cpu")
    first = answers[0]
    ids = torch.tensor([prompt_ids(tokenizer, first["prompt"])])
    stop = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    greedy = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, **stop
    )
    assert first["completion"] == tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True)
    assert first["prompt"] == cut[0]["prompt"]

    data = root / "data"
    run("data", "prepare", "--target", target, "--input", str(regen), "--out", str(data))
    doc = next(d for d in load_token_dataset(data) if d["id"] == first["id"])
    head = prompt_ids(tokenizer, first["prompt"])
    tail = tokenizer(first["completion"], add_special_tokens=False).input_ids
    assert list(doc["input_ids"]) == head + tail  # the prompt as served, then the continuation
    assert list(doc["loss_mask"]) == [0] * len(head) + [1] * len(tail)  # the loss on the continuation

    config = root / "train.yaml"
    config.write_text(yaml.safe_dump({
        "drafter": {"num_layers": 1, "num_taps": 2, "block_size": 8},
        "data": {"seq_len": 96, "rows_per_batch": 2}, "num_anchors": 4, "max_steps": 2,
    }))  # fmt: skip
    run("train", "--target", target, "--data", str(data), "--out", str(root / "run"), "--config", str(config),
        "--device", "cpu")  # fmt: skip
    ckpt = latest_checkpoint(root / "run" / "checkpoints")
    eval_prompts = root / "eval.jsonl"
    eval_prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in cut[:2]))
    report = root / "report.json"
    run("eval", "--target", target, "--drafter", str(ckpt), "--prompts", str(eval_prompts), "--out",
        str(report), "--max-new-tokens", "8", "--device", "cpu")  # fmt: skip
    assert json.loads(report.read_text())["identical_to_autoregressive"]["dflash"] == 2  # both prompts


def test_sampled_continuations_and_prompts_sampled_from_the_target(base):
    root, target = base.root, str(base.target)
    synth = root / "synth.jsonl"
    run("data", "synthesize", "--target", target, "--out", str(synth), "--count", "4", "--max-tokens", "12",
        "--batch-size", "4", "--device", "cpu", "--no-progress")  # fmt: skip
    sampled = records(synth)
    assert len(sampled) == 4 and all(r["prompt"].strip() and "messages" not in r for r in sampled)
    regen = root / "regen_t1.jsonl"
    run("data", "regenerate", "--target", target, "--input", str(synth), "--out", str(regen),
        "--max-tokens", "6", "--temperature", "1", "--device", "cpu", "--no-progress")  # fmt: skip
    assert [r["prompt"] for r in records(regen)] == [r["prompt"] for r in sampled]


def test_a_text_record_is_trained_on_whole_and_a_chat_record_is_refused_with_its_line(base, tmp_path):
    target = str(base.target)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"id": "t", "text": "def f(x):\n    return x\n"}) + "\n")
    run("data", "prepare", "--target", target, "--input", str(text), "--out", str(tmp_path / "t"))
    doc = next(iter(load_token_dataset(tmp_path / "t")))
    assert list(doc["loss_mask"]) == [0] + [1] * (len(doc["input_ids"]) - 1)  # all but <bos>

    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat.write_text(text.read_text() + json.dumps({"messages": turns}) + "\n")
    result = CliRunner().invoke(app, ["data", "prepare", "--target", target, "--input", str(chat), "--out",
                                      str(tmp_path / "c")])  # fmt: skip
    assert result.exit_code == 2 and f"{chat}:2" in result.output and "no chat template" in result.output
    assert not (tmp_path / "c" / "shards").exists()

    regen = tmp_path / "regen.jsonl"
    result = CliRunner().invoke(app, ["data", "regenerate", "--target", target, "--input", str(chat), "--out",
                                      str(regen), "--device", "cpu", "--no-progress"])  # fmt: skip
    assert result.exit_code == 1
    failed = {r["id"]: r["reason"] for r in records(tmp_path / "regen.jsonl.failed.jsonl")}
    assert failed == {"t": "no_prompt", "chat.jsonl:2": "no_chat_template"}


def test_an_eval_prompt_for_a_base_model_is_its_text(base):
    tok = base.tokenizer
    assert encode_prompt(tok, [{"role": "user", "content": "def f("}]) == prompt_ids(tok, "def f(")
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_prompts_skip_excluded_folders_and_stop_at_a_count(base, tmp_path):
    from flashdraft.data.prefixes import write_prefix_prompts

    tree = tmp_path / "tree"
    for folder in ("pkg", "tests"):
        (tree / folder).mkdir(parents=True)
        for f in stdlib_files(limit=3):
            (tree / folder / f.name).write_text(f.read_text(errors="replace"))
    out = tmp_path / "p.jsonl"
    summary = write_prefix_prompts([tree], base.tokenizer, out, 8, 40, 2, 0, "*.py", ("tests",), 5)
    ids = [r["id"] for r in records(out)]
    assert len(ids) == 5 and all(i.startswith("pkg/") for i in ids) and summary.files == 3
    whole = write_prefix_prompts([tree], base.tokenizer, out, 8, 40, 2, 0, "*.py")
    assert whole.files == 6 and whole.prompts == 12
