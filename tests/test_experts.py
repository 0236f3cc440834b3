"""flashdraft.model.experts: the gather_sum experts compute what the model's own experts compute, in
every family with routed experts behind transformers' experts interface; a target without routed experts
refuses them, naming the field."""

import pytest
import torch

from families import build
from flashdraft.config import resolve_config
from flashdraft.model.experts import NAME, set_target_experts


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_next", "deepseek_v3"])
def test_gather_sum_experts_compute_the_models_own_experts(family):
    model = build(family, vocab_size=64, eos_token_id=1, pad_token_id=0)
    ids = torch.randint(2, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    model.set_experts_implementation("eager")  # a loop over the experts: the plainest statement of them
    with torch.no_grad():
        want = model(ids).logits
        set_target_experts(model, NAME)
        got = model(ids).logits
    assert model.config.get_text_config()._experts_implementation == NAME
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_experts_numbered_past_a_byte_sort_as_themselves():
    """The pairs sort by a uint8 key up to 256 experts and an int16 key above: with 300 experts the
    tokens routed to experts 256 and up are computed by those experts."""
    from transformers import AutoModelForCausalLM

    from families import family_config

    config = family_config("qwen3_moe", 64, eos_token_id=1, pad_token_id=0)
    config.num_experts = 300
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for layer in model.model.layers:  # the other experts' logits 0: a token's best are 256 and up
        layer.mlp.gate.weight.data[:256] = 0.0
    ids = torch.randint(2, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        want = model(ids).logits
        set_target_experts(model, NAME)
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_auto_takes_gather_sum_where_the_model_takes_grouped_mm_and_keeps_any_other():
    model = build("qwen3_moe", vocab_size=64, eos_token_id=1, pad_token_id=0)
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default where it runs
    set_target_experts(model, "auto")
    assert model.config._experts_implementation == NAME
    model.set_experts_implementation("eager")
    set_target_experts(model, "auto")
    assert model.config._experts_implementation == "eager"


def test_a_target_without_routed_experts_refuses_them():
    model = build("qwen3", vocab_size=64, eos_token_id=1, pad_token_id=0)
    set_target_experts(model, "auto")  # nothing to set
    with pytest.raises(ValueError, match="target_experts 'gather_sum': the target has no routed experts"):
        set_target_experts(model, NAME)
    with pytest.raises(ValueError, match="target_experts"):
        resolve_config("default", target_experts="fastest")


def test_gather_sum_applies_a_post_expert_norm_as_transformers_grouped_mm_does():
    from transformers.integrations.moe import grouped_mm_experts_forward

    from flashdraft.model.experts import gather_sum_experts

    model = build("qwen3_moe", vocab_size=64, eos_token_id=1, pad_token_id=0)
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    experts.has_post_expert_norm = True  # as a family with a norm after each expert sets it
    experts.post_expert_norm = torch.nn.LayerNorm(model.config.hidden_size)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, model.config.hidden_size, generator=g)
    index = torch.randint(0, model.config.num_experts, (10, 2), generator=g)
    weights = torch.rand(10, 2, generator=g)
    with torch.no_grad():
        want = grouped_mm_experts_forward(experts, hidden, index, weights)
        got = gather_sum_experts(experts, hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_auto_keeps_expert_parallel_experts_and_gather_sum_refuses_them():
    model = build("qwen3_moe", vocab_size=64, eos_token_id=1, pad_token_id=0)
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m._is_expert_parallel = True
    set_target_experts(model, "auto")
    assert model.config._experts_implementation == "grouped_mm"
    with pytest.raises(ValueError, match="'gather_sum': the target's experts are expert-parallel"):
        set_target_experts(model, NAME)
