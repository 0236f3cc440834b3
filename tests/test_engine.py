"""`flashdraft export --format gguf`: the drafter as the DFlash GGUF llama.cpp loads, read back with
gguf.GGUFReader (names, metadata and tensors as llama.cpp build 11434's converter writes them)."""

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
