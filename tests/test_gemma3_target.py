"""A Gemma 3 text target as the GGUF llama-server serves, written by flashdraft's conversion
(flashdraft.export.gguf_gemma3, after llama.cpp build 11434's `Gemma3Model` converter) from a tiny
Gemma3ForCausalLM with a tokenizer of Gemma's kind (tests/tiny_gemma3.py), and loaded back as a target by
transformers' GGUF loader (which subtracts the + 1 from the norms and rebuilds a GemmaTokenizer from the
pieces). Equal f32 logits on prompts longer than the sliding window check the norms, the window, the
layer pattern and the RoPE bases; the file's fields are checked against what the converter writes."""

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

import tiny_gemma3
from flashdraft.export.gguf_target import write_gguf_target
from flashdraft.model.target import load_target

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The lazy dog sleeps; the fox proposes a block.",
    "  two  spaces\tand a tab, é → π (byte fallback)",
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model, tokenizer, hf, path = tiny_gemma3.write_target(tmp_path_factory.mktemp("gemma3"))
    loaded, loaded_tokenizer = load_target(path, "cpu")
    return model, tokenizer, hf, path, loaded, loaded_tokenizer


def test_the_gguf_loads_as_the_same_model_config_and_tokenizer(gemma3):
    source, tokenizer, _, _, loaded, loaded_tokenizer = gemma3
    assert type(loaded).__name__ == "Gemma3ForCausalLM" and loaded.dtype == torch.float32
    want, got = source.config, loaded.config
    assert got.layer_types == want.layer_types and "full_attention" in got.layer_types
    assert got.sliding_window == want.sliding_window == tiny_gemma3.WINDOW
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rope_parameters", "query_pre_attn_scalar"):  # fmt: skip
        assert getattr(got, key) == getattr(want, key), key
    assert got.tie_word_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = [torch.tensor([tokenizer(t).input_ids]) for t in TEXTS]
    prompts.append(torch.randint(5, len(tokenizer), (2, 3 * tiny_gemma3.WINDOW), generator=g))
    with torch.no_grad():
        for ids in prompts:
            torch.testing.assert_close(loaded(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert loaded_tokenizer(text).input_ids == ids
        assert loaded_tokenizer.decode(ids, skip_special_tokens=True) == text
    for role in ("bos", "eos", "pad", "unk", "mask"):  # Gemma's <mask> (4) is a drafter's mask token
        assert getattr(loaded_tokenizer, f"{role}_token_id") == getattr(tokenizer, f"{role}_token_id"), role
    assert loaded_tokenizer.mask_token_id == 4 and loaded_tokenizer.chat_template is None


def test_the_file_has_the_fields_and_tensors_of_llama_cpps_gemma3_converter(gemma3, tmp_path):
    source, tokenizer, hf, path, _, _ = gemma3
    reader = gguf.GGUFReader(path)
    field = {k: f.contents() for k, f in reader.fields.items()}
    assert field["general.architecture"] == "gemma3" and field["gemma3.block_count"] == tiny_gemma3.LAYERS
    assert field["gemma3.embedding_length"] == tiny_gemma3.HIDDEN
    assert field["gemma3.attention.key_length"] == field["gemma3.attention.value_length"] == 256
    assert field["gemma3.attention.head_count"] == 4 and field["gemma3.attention.head_count_kv"] == 1
    assert field["gemma3.rope.freq_base"] == 1e6 and field["gemma3.rope.freq_base_swa"] == 1e4
    assert field["gemma3.attention.sliding_window"] == tiny_gemma3.WINDOW
    # no pattern key: llama.cpp takes every sixth layer as full attention, as the model has them
    assert "gemma3.attention.sliding_window_pattern" not in field
    assert "gemma3.final_logit_softcapping" not in field and "gemma3.embedding_scale" not in field
    # the SentencePiece vocabulary: pieces, scores and types of tokenizer.model
    assert field["tokenizer.ggml.model"] == "llama" and field["tokenizer.ggml.pre"] == "default"
    assert field["tokenizer.ggml.tokens"] == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    types = field["tokenizer.ggml.token_type"]
    assert types[:5] == [3, 3, 3, 2, 3] and set(types[5:261]) == {6} and set(types[261:]) == {1}
    scores = field["tokenizer.ggml.scores"]
    assert scores[:261] == [0.0] * 261 and scores[261:] == [-float(i) for i in range(len(scores) - 261)]
    assert field["tokenizer.ggml.add_space_prefix"] is False and field["tokenizer.ggml.add_bos_token"] is True
    assert (field["tokenizer.ggml.bos_token_id"], field["tokenizer.ggml.eos_token_id"]) == (2, 1)
    assert "tokenizer.ggml.merges" not in field

    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp uses token_embd for the lm_head
    state = source.state_dict()
    # the embedding as it is: the graph scales it by sqrt(hidden_size)
    assert np.array_equal(tensors["token_embd.weight"], state["model.embed_tokens.weight"].numpy())
    for gguf_name, hf_name in [
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.0.post_attention_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
        ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
        ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
        ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:  # Gemma3RMSNorm scales by 1 + weight, llama.cpp's RMS norm by the weight
        assert np.array_equal(tensors[gguf_name], state[hf_name].numpy() + 1), gguf_name
    q = state["model.layers.0.self_attn.q_proj.weight"]  # NeoX RoPE: q's rows as transformers has them
    assert np.array_equal(tensors["blk.0.attn_q.weight"].reshape(q.shape), q.numpy())
    f16 = gguf.GGUFReader(write_gguf_target(hf, tmp_path / "f16.gguf", "f16"))
    kinds = {t.name: t.tensor_type.name for t in f16.tensors}
    assert kinds["blk.0.attn_q.weight"] == "F16" and kinds["blk.0.attn_norm.weight"] == "F32"


def test_what_llama_cpps_gemma3_graph_would_run_otherwise_is_refused(gemma3, tmp_path):
    _, _, hf, _, _, _ = gemma3
    src = shutil.copytree(hf, tmp_path / "edited")
    config = json.loads((src / "config.json").read_text())
    alternating = ["sliding_attention", "full_attention"] * 3 + ["sliding_attention"]
    sliding_rope = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    edits = {
        "layer_types": alternating,
        "query_pre_attn_scalar": 64,
        "attn_logit_softcapping": 50.0,
        "hidden_activation": "silu",
        "rope_parameters": config["rope_parameters"] | {"sliding_attention": sliding_rope},
    }
    (src / "config.json").write_text(json.dumps(config | edits))
    (src / "tokenizer.model").unlink()
    with pytest.raises(ValueError) as refused:
        write_gguf_target(src, tmp_path / "out.gguf")
    for problem in (
        "llama.cpp's gemma3 graph makes every sixth layer full attention",
        "query_pre_attn_scalar 64: llama.cpp scales queries by 1/sqrt(256)",
        "attn_logit_softcapping",
        "hidden_activation 'silu'",
        "sliding-attention rope_type 'linear'",
        "no tokenizer.model",
    ):
        assert problem in str(refused.value)
    assert not (tmp_path / "out.gguf").exists()


def test_the_gguf_tokenizer_adds_bos_as_the_file_says_even_when_transformers_leaves_it_out(
    tmp_path, monkeypatch
):
    """transformers 5.17 builds a Gemma GGUF tokenizer that adds no <bos> (5.24 adds it); the file's
    tokenizer.ggml.add_bos_token decides, as in llama.cpp."""
    from transformers import AutoTokenizer

    from flashdraft.model.target import load_tokenizer

    gguf_path = tiny_gemma3.write_target(tmp_path)[-1]
    built = AutoTokenizer.from_pretrained

    def without_bos(*args, **kwargs):  # as transformers 5.17 builds it
        tokenizer = built(*args, **kwargs)
        tokenizer.add_bos_token = False
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", without_bos)
    tokenizer = load_tokenizer(gguf_path)
    assert tokenizer("def f():", add_special_tokens=True).input_ids[0] == tokenizer.bos_token_id


def test_a_gemma_gguf_tokenizer_built_as_unigram_is_refused(tmp_path, monkeypatch):
    """transformers 5.17 builds a Gemma GGUF's SentencePiece vocabulary as Unigram, which splits text
    unlike llama.cpp (BPE merges): the target then writes "1. 1. 1." from ids it never saw. Refused."""
    from tokenizers import Tokenizer
    from tokenizers.models import Unigram
    from transformers import AutoTokenizer

    from flashdraft.model.target import load_tokenizer

    gguf_path = tiny_gemma3.write_target(tmp_path)[-1]
    built = AutoTokenizer.from_pretrained
    assert type(built(gguf_path.parent, gguf_file=gguf_path.name).backend_tokenizer.model).__name__ == "BPE"

    def as_unigram(*args, **kwargs):  # as transformers 5.17 builds it
        tokenizer = built(*args, **kwargs)
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        unigram = Tokenizer(Unigram([(token, -1.0) for token, _ in vocab], unk_id=tokenizer.unk_token_id))
        tokenizer._tokenizer = unigram
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", as_unigram)
    with pytest.raises(ValueError, match="Unigram.*transformers>=5.18"):
        load_tokenizer(gguf_path)
