"""`flashdraft export --format gguf`: the drafter as the DFlash GGUF llama.cpp loads, read back with
gguf.GGUFReader (names, metadata and tensors as llama.cpp build 11434's converter writes them); and
`flashdraft engine-check`, which serves it with a built llama-server (skipped without one)."""

import json

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


def test_gguf_export_refuses_a_target_or_option_llama_cpp_cannot_serve(drafter_and_files, tmp_path):
    _, ckpt, _ = drafter_and_files
    write_target_gguf(tmp_path / "other.gguf", layers=8, hidden=48)
    with pytest.raises(ValueError, match="target has layers 8.*\n.*hidden size 48"):
        export_checkpoint(ckpt, "gguf", tmp_path / "d.gguf", str(tmp_path / "other.gguf"))
    with pytest.raises(ValueError, match=r"the \.gguf file llama-server serves"):
        export_checkpoint(ckpt, "gguf", tmp_path / "d.gguf", str(tmp_path))
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


def _engine_check(files, drafter: str = "drafter.gguf"):
    from typer.testing import CliRunner

    from flashdraft.cli.main import app

    args = ["engine-check", "--target", str(files / "target.gguf"), "--drafter", str(files / drafter),
            "--prompts", str(files / "prompts.jsonl"), "--out", str(files / "engine" / "report.json"),
            "--max-new-tokens", "24", "--threads", "1", "--draft-max", str(BLOCK - 1)]  # fmt: skip
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
