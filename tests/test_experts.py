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
