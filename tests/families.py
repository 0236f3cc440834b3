"""Tiny random models of every target family the conformance tests cover, built from configs (nothing
downloaded): 6 layers of width 32, so the drafter's default taps are layers 1 and 3 and layers 4-5
never run in training. Windows of 8 tokens make sliding-window layers matter in short documents."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

LAYERS = 6
WINDOW = 8
_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
_ALTERNATING = ["sliding_attention", "full_attention"] * (LAYERS // 2)

# family -> (model_type, config fields, how packed rows keep documents apart: flashdraft.model.target)
FAMILIES: dict[str, tuple[str, dict, str]] = {
    "qwen3": ("qwen3", {}, "positions"),
    "llama": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        "positions",
    ),
    "mistral": ("mistral", dict(sliding_window=WINDOW), "positions"),
    "qwen3_moe": ("qwen3_moe", dict(_MOE, num_experts=4), "positions"),
    "gemma3_text": ("gemma3_text", dict(sliding_window=WINDOW, layer_types=_ALTERNATING), "positions"),
    # Gemma3ForConditionalGeneration: a vision tower and the text model above; its embedding and lm_head
    # are tied, as in Gemma 3's checkpoints
    "gemma3": ("gemma3", {}, "positions"),
    "gpt_oss": (
        "gpt_oss",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, layer_types=_ALTERNATING),
        "masks",
    ),
    "qwen3_next": (
        "qwen3_next",
        dict(
            _MOE,
            num_experts=4,
            shared_expert_intermediate_size=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
        ),
        "one_document",
    ),
    "phi3": ("phi3", {}, "positions"),
    "deepseek_v3": (  # multi-head latent attention, shared + routed experts
        "deepseek_v3",
        dict(
            _MOE,
            num_key_value_heads=4,  # MLA: one key/value head per query head
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
        ),
        "positions",
    ),
}


# drafter shapes set by hand, where the target's attention does not suit a small drafter (MLA)
DRAFTER_SHAPES = {"deepseek_v3": dict(num_key_value_heads=2, head_dim=16, intermediate_size=48)}


def family_config(name: str, vocab_size: int, eos_token_id: int, pad_token_id: int):
    model_type, fields, _ = FAMILIES[name]
    tokens = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if model_type == "gemma3":
        text = family_config("gemma3_text", vocab_size, eos_token_id, pad_token_id).to_dict()
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)  # fmt: skip
        return AutoConfig.for_model(
            "gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4, **tokens
        )
    own_head_dim = model_type in ("phi3", "deepseek_v3")  # hidden // heads; MLA: its rope part
    shape = {k: v for k, v in _SHAPE.items() if k != "head_dim" or not own_head_dim}
    return AutoConfig.for_model(model_type, **{**shape, **fields}, **tokens)


def build(name: str, vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0) -> PreTrainedModel:
    """A random model of the family with a peaked lm_head (a trained target's greedy choices are not
    near-ties, and a drafter can learn them)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name, vocab_size, eos_token_id, pad_token_id))
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return model.eval()
