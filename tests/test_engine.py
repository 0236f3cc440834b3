"""`flashdraft export --format gguf`: the drafter as the DFlash GGUF llama.cpp loads, read back with
gguf.GGUFReader (names, metadata and tensors as llama.cpp build 11434's converter writes them); and, with
a built llama-server (skipped without one): an HF target converted for it (flashdraft.export.gguf_target)
decodes, tokenizes and samples as transformers does, and `flashdraft engine-check` serves the drafter,
at T = 0 and above, beside a `flashdraft eval` report's tau, accepting what our eval accepts for trained
DFlash and DFlash2 drafters."""

import json
import re

import gguf
import numpy as np
import pytest
import torch

from flashdraft.export.formats import export_checkpoint
from flashdraft.model.checkpoint import write_zlab
from helpers import BLOCK, MASK_ID, VOCAB, tiny_drafter, tiny_target


def write_target_gguf(path, layers: int = 6, hidden: int = 32, vocab: int = VOCAB) -> None:
    """The keys of a target GGUF the drafter's file reads: its shape and its tokenizer."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def drafter_and_files(tmp_path):
    drafter = tiny_drafter(tiny_target())
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter, tmp_path / "ckpt")
    write_target_gguf(tmp_path / "target.gguf")
    return drafter, tmp_path / "ckpt", tmp_path / "target.gguf"


def test_gguf_export_has_the_names_and_metadata_llama_cpp_reads(drafter_and_files, tmp_path):
    drafter, ckpt, target = drafter_and_files
    out = export_checkpoint(ckpt, "gguf", tmp_path / "drafter.gguf", str(target))
    reader = gguf.GGUFReader(out)
    field = {k: f.contents() for k, f in reader.fields.items()}
    assert field["general.architecture"] == "dflash"
    assert field["dflash.block_size"] == BLOCK
    assert field["dflash.target_layers"] == [i + 1 for i in drafter.target_layer_ids]  # a layer's input
    assert field["tokenizer.ggml.mask_token_id"] == MASK_ID
    assert field["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(VOCAB)]  # the target's vocabulary
    assert field["dflash.block_count"] == len(drafter.layers)
    assert "dflash.attention.causal" not in field  # llama.cpp's default for DFlash: non-causal blocks

    tensors = {t.name: t for t in reader.tensors}
    per_layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip
    names = {f"blk.{i}.{n}.weight" for i in range(len(drafter.layers)) for n in per_layer}
    assert tensors.keys() == names | {"fc.weight", "enc.output_norm.weight", "output_norm.weight"}
    for t in tensors.values():
        expected = gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else gguf.GGMLQuantizationType.BF16
        assert t.tensor_type == expected, t.name
    fc = drafter.fc.weight.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(np.asarray(tensors["fc.weight"].data).view(np.uint16).reshape(fc.shape), fc)
    norm = drafter.hidden_norm.weight.detach().to(torch.bfloat16).float().numpy()
    assert np.array_equal(np.asarray(tensors["enc.output_norm.weight"].data), norm)


@pytest.mark.parametrize("kind, tol", [("f32", 0.0), ("f16", 1e-3), ("q8_0", 1e-2)])
def test_gguf_export_writes_the_matrices_in_the_type_asked(drafter_and_files, tmp_path, kind, tol):
    drafter, ckpt, target = drafter_and_files
    out = export_checkpoint(ckpt, "gguf", tmp_path / f"{kind}.gguf", str(target), gguf_type=kind)
    reader = gguf.GGUFReader(out)
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    tensors = {t.name: t for t in reader.tensors}
    assert {t.tensor_type for t in tensors.values() if len(t.shape) > 1} == {qtype}
    assert {t.tensor_type for t in tensors.values() if len(t.shape) == 1} == {gguf.GGMLQuantizationType.F32}
    fc = gguf.quants.dequantize(tensors["fc.weight"].data, qtype)
    weight = drafter.fc.weight.detach().to(torch.bfloat16).float().numpy()  # the checkpoint holds bf16
    assert np.abs(fc.reshape(weight.shape) - weight).max() <= tol * np.abs(weight).max()
    file_type = reader.fields["general.file_type"].contents()
    assert file_type == {"f32": 0, "f16": 1, "q8_0": 7}[kind]  # llama.cpp's LLAMA_FTYPE_ALL_F32, ...


def test_gguf_export_refuses_a_target_or_option_llama_cpp_cannot_serve(drafter_and_files, tmp_path):
    _, ckpt, _ = drafter_and_files
    write_target_gguf(tmp_path / "other.gguf", layers=8, hidden=48)
    with pytest.raises(ValueError, match="target has layers 8.*\n.*hidden size 48"):
        export_checkpoint(ckpt, "gguf", tmp_path / "d.gguf", str(tmp_path / "other.gguf"))
    with pytest.raises(ValueError, match=r"the \.gguf file llama-server serves"):
        export_checkpoint(ckpt, "gguf", tmp_path / "d.gguf", str(tmp_path))
    with pytest.raises(ValueError, match="tensor type 'q4'"):
        export_checkpoint(ckpt, "gguf", tmp_path / "d.gguf", str(tmp_path / "target.gguf"), gguf_type="q4")
    export_checkpoint(ckpt, "gguf", tmp_path / "drafter.gguf", str(tmp_path / "target.gguf"))
    with pytest.raises(ValueError, match="drafter.gguf: a DFlash drafter's GGUF, not a target"):
        export_checkpoint(ckpt, "gguf", tmp_path / "d.gguf", str(tmp_path / "drafter.gguf"))
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "target.gguf").read_bytes()[:100])
    with pytest.raises(ValueError, match="cut.gguf: a GGUF file that does not parse, truncated?"):
        export_checkpoint(ckpt, "gguf", tmp_path / "d.gguf", str(tmp_path / "cut.gguf"))
    assert not (tmp_path / "d.gguf").exists()


# ---- `flashdraft engine-check`: the drafter served by a built llama-server -----------------------


@pytest.fixture
def llama_server():
    from flashdraft.eval.engine import find_server

    try:
        return find_server()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _servers_serving(path) -> list[str]:
    """Command lines of the live processes that name `path` (a zombie's command line is empty)."""
    from pathlib import Path

    lines = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "llama-server" in text and str(path) in text:
            lines.append(text)
    return lines


@pytest.fixture
def served_files(tiny_tokenizer, tmp_path):
    """A tiny Llama target as a GGUF llama.cpp loads, a drafter for it exported as GGUF, two prompts."""
    from flashdraft.model.drafter import DFlashDrafter, drafter_config
    from flashdraft.train.build import init_drafter_
    from test_gguf import tiny_llama, write_gguf

    tok = tiny_tokenizer
    model = tiny_llama(tok)
    write_gguf(model, tok, tmp_path / "target.gguf")
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    drafter = DFlashDrafter(drafter_config(model.config, 1, None, 2, BLOCK, mask_id))
    init_drafter_(drafter, std=0.1, seed=0)
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter.eval(), tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", "gguf", tmp_path / "drafter.gguf", str(tmp_path / "target.gguf"))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "add two numbers"}\n{"prompt": "open a file"}\n')
    return tmp_path


def _engine_check(files, drafter: str = "drafter.gguf", target: str = "target.gguf", *options: str):
    from typer.testing import CliRunner

    from flashdraft.cli.main import app

    args = ["engine-check", "--target", str(files / target), "--drafter", str(files / drafter),
            "--prompts", str(files / "prompts.jsonl"), "--out", str(files / "engine" / "report.json"),
            "--max-new-tokens", "24", "--threads", "1", "--draft-max", str(BLOCK - 1), *options]  # fmt: skip
    return CliRunner().invoke(app, args)


def test_engine_check_serves_the_drafter_losslessly_and_stops_the_server(llama_server, served_files):
    result = _engine_check(served_files)
    assert result.exit_code == 0, result.output
    report = json.loads((served_files / "engine" / "report.json").read_text())
    assert report["verify_steps"] > 0 and report["drafted"] > 0  # llama.cpp really drafted with it
    assert report["tau"] >= 1
    assert report["tau_pooled"] == pytest.approx(1 + report["accepted"] / report["verify_steps"])
    assert report["completions"]["dflash"] == report["completions"]["plain"]  # lossless at T = 0
    assert report["identical_to_plain"] == report["requests"] == 2
    assert report["tokens_per_s_plain"] > 0 and report["tokens_per_s_drafter"] > 0
    assert _servers_serving(served_files) == []


def test_engine_check_names_a_server_that_dies_with_the_end_of_its_log(llama_server, served_files):
    broken = served_files / "broken.gguf"
    broken.write_bytes((served_files / "drafter.gguf").read_bytes()[:4096])  # a header, its tensors cut off
    result = _engine_check(served_files, drafter=broken.name)
    assert result.exit_code == 1
    assert "llama-server exited with code" in result.output
    assert "llama-server.dflash.log" in result.output and "broken.gguf" in result.output  # the log's tail
    assert _servers_serving(served_files) == []


def test_engine_check_refuses_what_is_not_a_drafter_or_a_target_before_any_server(served_files, tmp_path):
    """Each refusal names the option and the path, exit code 2, whether or not a server is built. (A drafter
    cut short past its header is llama-server's to find: the test above.)"""
    cases = {
        ("ckpt", "target.gguf"): "--drafter .*ckpt: a directory, not a .gguf file; export the drafter",
        ("ckpt/model.safetensors", "target.gguf"): "model.safetensors: not a GGUF file; export the drafter",
        ("target.gguf", "target.gguf"): "target.gguf: a GGUF of a 'llama' model, not a DFlash drafter",
        ("target.gguf", "drafter.gguf"): "--target .*drafter.gguf: a DFlash drafter's GGUF, not a target "
        r"\(--target and --drafter swapped\?\)",
    }
    for (drafter, target), message in cases.items():
        result = _engine_check(served_files, drafter, target, "--server", str(tmp_path / "no-server"))
        assert result.exit_code == 2, result.output
        assert re.search(message, " ".join(result.output.split())), result.output
    assert not (served_files / "engine").exists()


def test_the_architecture_is_read_from_the_header_or_else_from_the_whole_file(tmp_path, monkeypatch):
    from gguf.gguf_writer import GGUFValue

    from flashdraft.export.gguf_drafter import gguf_architecture

    first, later = tmp_path / "first.gguf", tmp_path / "later.gguf"
    write_target_gguf(first)
    w = gguf.GGUFWriter(str(later), "llama")  # general.architecture after another key
    w.kv_data[0] = {"a.first": GGUFValue(1, gguf.GGUFValueType.UINT32), **w.kv_data[0]}
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert gguf_architecture(later, "--x") == "llama"  # the whole parse
    parsed = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parsed.append(a) or pytest.fail("parsed"))
    assert gguf_architecture(first, "--x") == "llama" and not parsed  # the header's first key only


def test_engine_check_puts_an_evals_tau_beside_the_engines_and_refuses_an_eval_of_other_prompts(
    llama_server, served_files
):
    """At T = 1, with the target as its HF directory (converted next to the report) and --compare: ours,
    the reference's and the engine's tau per prompt and as means; an eval of other prompts or settings
    is refused before any server starts."""
    settings = {"prompts": str(served_files / "prompts.jsonl"), "num_prompts": 2, "max_new_tokens": 24,
                "temperature": 1.0, "thinking": False, "block_size": BLOCK}  # fmt: skip
    ours = {"settings": settings, "dflash": {"tau_per_sample": [1.5, 2.0]}}
    (served_files / "eval.json").write_text(json.dumps(ours | {"reference": {"tau_per_sample": [1.5, 2.5]}}))
    compare = ("--temperature", "1", "--compare", str(served_files / "eval.json"))
    result = _engine_check(served_files, "drafter.gguf", "target.hf", *compare)
    assert result.exit_code == 0, result.output
    report = json.loads((served_files / "engine" / "report.json").read_text())
    assert (
        report["settings"]["temperature"] == 1.0 and "identical_to_plain" not in report
    )  # lossless only at T = 0
    converted = served_files / "engine" / "target.hf.f32.gguf"
    assert report["settings"]["target"] == str(converted) and converted.is_file()
    beside = report["compare"]
    assert beside["tau"] == {"ours": 1.75, "reference": 2.0, "engine": pytest.approx(report["tau"])}
    assert beside["engine_vs_ours"] == pytest.approx(report["tau"] / 1.75 - 1)
    assert [(row["ours"], row["reference"]) for row in beside["per_prompt"]] == [(1.5, 1.5), (2.0, 2.5)]
    assert [row["engine"] for row in beside["per_prompt"]] == report["tau_per_request"]
    assert "tau over 2 prompts: ours 1.75, reference 2.00, engine" in result.output

    (served_files / "other.jsonl").write_text((served_files / "prompts.jsonl").read_text())
    settings["prompts"] = str(served_files / "other.jsonl")
    (served_files / "eval.json").write_text(json.dumps(ours))
    result = _engine_check(served_files, "drafter.gguf", "target.gguf", *compare[2:], "--max-prompts", "1")
    assert result.exit_code == 2
    for problem in ("the eval read " + settings["prompts"], "the eval decoded the first 2, this check 1",
                    "temperature: the eval's 1.0, this check's 0.0"):  # fmt: skip
        assert problem in result.output
    assert _servers_serving(served_files) == []


@pytest.fixture
def qwen3_target(tiny_tokenizer, tmp_path):
    """(a seeded tiny Qwen3 whose logits spread, its HF directory)."""
    from flashdraft.demo.tiny import build_tiny_target, save_target

    torch.manual_seed(0)
    model = build_tiny_target(tiny_tokenizer).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    return model, save_target(model, tiny_tokenizer, tmp_path / "qwen3")


def test_an_hf_target_in_llama_server_tokenizes_decodes_and_samples_as_transformers(
    llama_server, qwen3_target, tiny_tokenizer, tmp_path
):
    """Converted to GGUF (f32): llama-server's tokens of a string, its text of them, its greedy tokens
    are transformers'; at T = 3 it samples softmax(logits / T) over the whole vocabulary, as our eval
    does, not after llama.cpp's default top_k 40 and min_p 0.05."""
    from flashdraft.eval.engine import LlamaServer, ServerOptions
    from flashdraft.export.gguf_target import served_target

    model, hf = qwen3_target
    tok = tiny_tokenizer
    text = "def f(x):\n\treturn x['a'] + 3.14  # it's 2 spaces  \n\n  ok? \u00fcn\u00ef \U0001f999 done"
    ids = tok(text, add_special_tokens=False).input_ids
    prompt = ids[:16]
    opts = ServerOptions(threads=1, ctx_size=256)
    with LlamaServer(
        llama_server, served_target(hf, tmp_path), None, tmp_path / "server.log", opts
    ) as server:
        assert server.client.post("/tokenize", json={"content": text}).json()["tokens"] == ids
        assert server.client.post("/detokenize", json={"tokens": ids}).json()["content"] == tok.decode(ids)
        greedy = server.complete(prompt, 40, seed=0)["tokens"]
        sampled = server.complete(prompt, 64, seed=0, temperature=3.0)["tokens"]
    with torch.no_grad():
        ours = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :]
        logits = model(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1]
    assert len(greedy) == 40 and greedy == ours.tolist()
    probs = torch.softmax(logits / 3.0, dim=-1)
    picked = probs[torch.arange(len(sampled)), torch.tensor(sampled)]
    assert (probs > picked[:, None]).sum(-1).max() >= 40  # a token past the 40 most probable
    assert (picked / probs.max(-1).values).min() < 0.05  # a token min_p 0.05 would have cut


@pytest.mark.parametrize("stored", ["lm_head.weight", "model.embed_tokens.weight"])
def test_a_target_with_tied_embeddings_serves_its_one_matrix_at_both_ends(
    llama_server, tiny_tokenizer, tmp_path, stored
):
    """SmolLM2 ties its lm_head to its embedding, and a directory may store the matrix under either name:
    the GGUF holds it as token_embd (llama.cpp's lm_head then too) and greedy decoding is transformers'."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3ForCausalLM

    from flashdraft.demo.tiny import build_tiny_target, save_target
    from flashdraft.eval.engine import LlamaServer, ServerOptions
    from flashdraft.export.gguf_target import served_target

    torch.manual_seed(0)
    config = build_tiny_target(tiny_tokenizer).config
    config.tie_word_embeddings = True
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # tied: the embedding too
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf = save_target(model, tiny_tokenizer, tmp_path / "tied")
    weights = load_file(hf / "model.safetensors")
    weights.pop("lm_head.weight", None)
    weights.pop("model.embed_tokens.weight", None)
    save_file(weights | {stored: model.lm_head.weight.detach().clone()}, hf / "model.safetensors")
    prompt = tiny_tokenizer("def add(a, b):", add_special_tokens=False).input_ids
    with LlamaServer(
        llama_server,
        served_target(hf, tmp_path),
        None,
        tmp_path / "server.log",
        ServerOptions(threads=1, ctx_size=128),
    ) as server:
        greedy = server.complete(prompt, 24, seed=0)["tokens"]
    with torch.no_grad():
        ours = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
    assert greedy == ours.tolist()


# the Split regexes of Qwen2/Qwen3's and Llama 3's tokenizer.json, with the BPE's ignore_merges
SPLITS = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+", False),
    "llama3": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+", True),
}  # fmt: skip


@pytest.mark.parametrize("split", SPLITS)
def test_llama_server_tokenizes_as_a_split_then_byte_level_tokenizer_does(llama_server, split, tmp_path):
    """A target whose tokenizer splits on Qwen2's or Llama 3's regex before its byte-level BPE, as the
    released ones do: llama-server's tokens and text are transformers'."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from flashdraft.demo.tiny import SPECIAL_TOKENS, build_tiny_target, save_target, stdlib_files
    from flashdraft.eval.engine import LlamaServer, ServerOptions
    from flashdraft.export.gguf_target import served_target

    regex, ignore_merges = SPLITS[split]
    backend = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet)
    # numbers, for merges of digits: Qwen2's regex splits digits one by one, Llama 3's in threes
    numbers = " ".join(str(n) for n in range(0, 10**6, 997))
    texts = [numbers] + [p.read_text(errors="replace") for p in stdlib_files(limit=20)]
    backend.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf = save_target(build_tiny_target(tok, layers=1), tok, tmp_path / "target")
    text = (
        "def f(x):\n\treturn x['A'] + 3.14  # it's 1000000 or 2000  \n\n  I'LL \u00fcn\u00ef \U0001f999 ok?"
    )
    ids = tok(text, add_special_tokens=False).input_ids
    opts = ServerOptions(threads=1, ctx_size=128)
    with LlamaServer(
        llama_server, served_target(hf, tmp_path), None, tmp_path / "server.log", opts
    ) as server:
        assert server.client.post("/tokenize", json={"content": text}).json()["tokens"] == ids
        assert server.client.post("/detokenize", json={"tokens": ids}).json()["content"] == tok.decode(ids)


def test_a_target_whose_llama_cpp_graph_cannot_feed_a_drafter_is_refused_before_any_server(served_files):
    """llama.cpp build 11434's Gemma 3 graph records no layer inputs: llama-server aborts at the first
    request of a DFlash drafter for it ("layer input tensor is null", seen with Gemma 3 270M)."""
    import tiny_gemma3
    from flashdraft.eval.engine import check_dflash_target, engine_check

    gemma = tiny_gemma3.write_target(served_files / "gemma")[-1]
    with pytest.raises(ValueError, match="a 'gemma3' target's does not"):
        engine_check(
            served_files / "no-server", gemma, served_files / "drafter.gguf", [[1]], 4, None, served_files
        )
    check_dflash_target(served_files / "target.gguf")  # a Llama target is served


PROMPTS = ["add two numbers", "open a file", "sort a list", "read a csv", "print hello", "merge dicts"]


@pytest.fixture(scope="module")
def trained_drafters(tmp_path_factory, tiny_tokenizer):
    """A tiny Qwen3 target (HF directory) with heads of 64, six prompts, and two drafter checkpoints: DFlash
    trained on the target's greedy continuations of the prompts, and DFlash2 made from it with its
    convolutions and selector moved off that start, so that its drafts differ. (With heads of 16,
    llama.cpp's CPU flash attention drafted otherwise than ours past about 64 positions; -fa off agreed.)"""
    from flashdraft.demo.tiny import build_tiny_target, save_target
    from flashdraft.eval.spec import chat_messages, encode_prompt
    from flashdraft.model.dflash2 import DFlash2Settings
    from flashdraft.model.drafter import DFlashDrafter, drafter_config
    from flashdraft.model.target import Target
    from flashdraft.train.build import init_drafter_
    from test_dflash2_decode import moved_off_dflash
    from test_eval_spec import train_on_continuations

    root = tmp_path_factory.mktemp("served_pair")
    tok = tiny_tokenizer
    torch.manual_seed(0)
    model = build_tiny_target(tok, hidden=128, heads=2, kv_heads=1).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # peaked logits: continuations a drafter can learn
    save_target(model, tok, root / "target")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    mask = tok.convert_tokens_to_ids("<|mask|>")
    dflash = DFlashDrafter(drafter_config(model.config, 2, None, 2, BLOCK, mask))
    init_drafter_(dflash, std=0.1, seed=0)
    prompts = [encode_prompt(tok, chat_messages({"prompt": p})) for p in PROMPTS]
    train_on_continuations(dflash, Target(model, dflash.target_layer_ids), prompts)
    settings = DFlash2Settings(conv_kernel_size=2, conv_group_size=16, selector_rank=6, selector_top_k=4,
                               output_multiplier=1.0, final_logit_softcapping=None)  # fmt: skip
    dflash2 = moved_off_dflash(dflash, settings)
    for name, drafter in (("dflash", dflash), ("dflash2", dflash2)):
        (root / name).mkdir()
        write_zlab(drafter.eval(), root / name)
    return root


def test_llama_server_accepts_the_drafts_our_eval_accepts_for_dflash_and_dflash2(
    llama_server, trained_drafters
):
    """Our eval's tau per prompt and llama-server's for the exported GGUF (f32) are the same, for DFlash and
    for DFlash2, whose selector walks its own path through each position's candidates (llama.cpp reads it
    from the file): where DFlash2 drafts differently from DFlash, the engine follows DFlash2."""
    from typer.testing import CliRunner

    from flashdraft.cli.main import app
    from flashdraft.export.gguf_target import served_target

    root, tau = trained_drafters, {}
    served = served_target(root / "target", root)  # the target as llama-server's f32 GGUF
    prompts = ["--prompts", str(root / "prompts.jsonl"), "--max-new-tokens", "96"]
    for kind in ("dflash", "dflash2"):
        ours = root / f"{kind}.eval.json"
        args = ["eval", "--target", str(root / "target"), "--drafter", str(root / kind), *prompts]
        result = CliRunner().invoke(app, [*args, "--device", "cpu", "--out", str(ours)])
        assert result.exit_code == 0, result.output
        drafter = export_checkpoint(root / kind, "gguf", root / f"{kind}.gguf", str(served), gguf_type="f32")
        engine = root / f"{kind}.engine" / "report.json"
        args = [
            "engine-check",
            "--target",
            str(served),
            "--drafter",
            str(drafter),
            *prompts,
            "--threads",
            "1",
        ]
        args += ["--draft-max", str(BLOCK - 1), "--compare", str(ours), "--out", str(engine)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        report = json.loads(engine.read_text())
        assert report["identical_to_plain"] == len(PROMPTS)
        tau[kind] = [(round(r["ours"], 2), round(r["engine"], 2)) for r in report["compare"]["per_prompt"]]
        # equal but where a near-tie rounds otherwise in a verify of 8 tokens and in one-token forwards
        assert sum(o == e for o, e in tau[kind]) >= len(PROMPTS) - 2, tau[kind]
        assert report["compare"]["engine_vs_ours"] == pytest.approx(0, abs=0.03)
    departs = [
        i for i, (d1, d2) in enumerate(zip(tau["dflash"], tau["dflash2"], strict=True)) if d1[0] != d2[0]
    ]
    assert departs and any(tau["dflash2"][i][1] == tau["dflash2"][i][0] for i in departs), tau
