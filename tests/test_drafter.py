"""The drafter and the target wrapper: attention paths, leakage, training vs inference form."""

import pytest
import torch

from flashdraft.model.drafter import Visibility, drafter_config
from flashdraft.model.target import Target
from flashdraft.train.blocks import Anchors, make_blocks
from flashdraft.train.step import Kernels, plan_micro_batch, target_features, visibility_for
from helpers import BLOCK, GAMMA, MASK_ID, packed_batch, target_and_drafter, tiny_target

# the flex path runs uncompiled here on purpose: these tests check what it computes against the
# dense path (the trainer compiles it)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _block_logits(target, drafter, batch, anchors, attention="dense", features=None, block_embeds=None):
    """Logits [b, n*B, V] of every block (training form, many blocks under one mask)."""
    blocks = make_blocks(batch.input_ids, batch.loss_mask, batch.position_ids, anchors, BLOCK, MASK_ID, GAMMA)
    feats = target_features(target, batch) if features is None else features
    embeds = target.embed_tokens(blocks.input_ids) if block_embeds is None else block_embeds
    from flashdraft.train.step import MicroBatch

    vis = visibility_for(MicroBatch(batch, anchors, blocks), BLOCK, attention, compiled=False)
    with torch.no_grad():
        hidden = drafter(embeds, blocks.positions, None, vis, feats, batch.position_ids)
        return target.lm_head(hidden)


def _layers_run(model) -> list[int]:
    """Indices of the decoder layers that ran, in order, appended to by forward pre-hooks."""
    ran: list[int] = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: ran.append(i))
    return ran


def test_target_features_are_the_outputs_of_the_tapped_layers_and_later_layers_never_run():
    full = tiny_target()
    ids = torch.randint(0, 90, (2, 24))
    with torch.no_grad():
        hs = full(ids, output_hidden_states=True).hidden_states
    target = Target(tiny_target(), [1, 3])
    ran = _layers_run(target.model)
    feats = target.features(ids)
    torch.testing.assert_close(feats, torch.cat([hs[2], hs[4]], -1))  # output of layer i = hs[i + 1]
    assert ran == [0, 1, 2, 3]  # the forward stopped after the last tapped layer
    assert len(target.model.model.layers) == 6  # and the model is whole: eval decodes with it
    ran.clear()
    target.decode(ids[:1])
    assert ran == [0, 1, 2, 3, 4, 5]


def test_tap_minus_one_is_the_token_embedding_and_runs_no_layer():
    """The no-target-features ablation: its drafter sees embed(context tokens), no target layer runs."""
    ids = torch.randint(0, 90, (2, 24))
    target = Target(tiny_target(), [-1])
    ran = _layers_run(target.model)
    torch.testing.assert_close(target.features(ids), target.embed_tokens(ids))
    assert ran == []
    both = Target(tiny_target(), [-1, 1])
    assert both.features(ids)[..., : both.model.config.hidden_size].equal(both.embed_tokens(ids))
    with pytest.raises(ValueError, match="do not fit"):
        Target(tiny_target(), [-2])


def test_packed_target_features_equal_each_document_alone():
    target, _ = target_and_drafter()
    batch = packed_batch([[20, 30]], seq_len=64)
    feats = target_features(target, batch)
    second = batch.input_ids[:, 20:50]
    alone = target.features(second)
    torch.testing.assert_close(feats[:, 20:50], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "rows, seq_len, n",
    [([[40, 50], [90]], 96, 10), ([[60, 60], [128]], 128, 16)],  # create_block_mask / structured mask
)
def test_flex_and_dense_paths_give_the_same_block_logits(rows, seq_len, n):
    target, drafter = target_and_drafter()
    batch = packed_batch(rows, seq_len=seq_len)
    mb = plan_micro_batch(batch, n, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0))
    dense = _block_logits(target, drafter, batch, mb.anchors, "dense")
    flex = _block_logits(target, drafter, batch, mb.anchors, "flex")
    valid = mb.anchors.valid.repeat_interleave(BLOCK, dim=1)
    torch.testing.assert_close(flex[valid], dense[valid], atol=1e-4, rtol=1e-4)


def test_acceptance_at_every_anchor_is_the_same_on_the_flex_path_with_padded_passes():
    """Validation's dense passes on the structured flex mask (the GPU path): the last pass holds padding
    anchors, and in one row nothing but padding."""
    from flashdraft.train.blocks import every_anchor, fits_structured
    from flashdraft.train.step import acceptance_map

    target, drafter = target_and_drafter()
    batch = packed_batch([[60, 60], [128]], seq_len=128)
    n = 128 // BLOCK
    passes = every_anchor(batch.loss_mask, batch.doc_ids, BLOCK, n)
    assert fits_structured(128, n, BLOCK) and not passes[-1].valid[0].any() and passes[-1].valid[1].any()
    feats = target_features(target, batch)
    with torch.no_grad():
        dense = acceptance_map(drafter, target, batch, feats, n, GAMMA, Kernels("dense"))
        flex = acceptance_map(drafter, target, batch, feats, n, GAMMA, Kernels("flex"))
    assert torch.equal(flex, dense) and (dense > 0).sum() > 100


@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_no_leakage_from_features_at_or_after_the_anchor_or_other_blocks(attention):
    target, drafter = target_and_drafter()
    batch = packed_batch([[80]], seq_len=80)
    anchors = Anchors(torch.tensor([[20, 45, 60]]), torch.tensor([[True, True, True]]))
    feats = target_features(target, batch)
    blocks = make_blocks(batch.input_ids, batch.loss_mask, batch.position_ids, anchors, BLOCK, MASK_ID, GAMMA)
    embeds = target.embed_tokens(blocks.input_ids)
    base = _block_logits(target, drafter, batch, anchors, attention, feats, embeds)
    j, a = 1, 45
    rows = slice(j * BLOCK, (j + 1) * BLOCK)

    later = feats.clone()
    later[:, a:] += torch.randn_like(later[:, a:])  # the anchor's own features and everything after
    other = embeds.clone()
    other[:, : j * BLOCK] += 1.0  # every other block's tokens
    other[:, (j + 1) * BLOCK :] += 1.0
    changed = _block_logits(target, drafter, batch, anchors, attention, later, other)
    torch.testing.assert_close(changed[:, rows], base[:, rows])

    earlier = feats.clone()
    earlier[:, a - 1] += 1.0  # the last context position before the anchor
    moved = _block_logits(target, drafter, batch, anchors, attention, earlier, embeds)
    assert (moved[:, rows] - base[:, rows]).abs().max() > 1e-4


def test_training_form_equals_inference_form():
    """Many blocks under one mask give the same logits as one block with its context as K/V."""
    target, drafter = target_and_drafter()
    batch = packed_batch([[70]], seq_len=72)
    anchors = Anchors(torch.tensor([[10, 33, 50]]), torch.tensor([[True, True, True]]))
    trained = _block_logits(target, drafter, batch, anchors, "dense")
    feats = target_features(target, batch)
    for j, a in enumerate([10, 33, 50]):
        block = torch.full((1, BLOCK), MASK_ID)
        block[0, 0] = batch.input_ids[0, a]
        positions = torch.arange(a, a + BLOCK)[None]
        with torch.no_grad():
            ctx_kv = drafter.context_kv(drafter.fuse(feats[:, :a]), batch.position_ids[:, :a])
            hidden = drafter(target.embed_tokens(block), positions, ctx_kv, Visibility(None))
            logits = target.lm_head(hidden)
        torch.testing.assert_close(logits, trained[:, j * BLOCK : (j + 1) * BLOCK], atol=1e-5, rtol=1e-5)


def test_drafter_state_holds_only_the_zlab_weights():
    _, drafter = target_and_drafter()
    names = set(drafter.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)


def test_the_drafter_shape_follows_the_target_unless_set():
    """An MLA target (DeepSeek-V3's shape: 128 heads and 128 key/value heads) gives by default a drafter
    of its attention shape, over 3B parameters in 5 layers; set by hand, heads, head size and MLP width
    are the ones asked, and the width stays the target's."""
    from transformers import AutoConfig

    from flashdraft.train.flops import layer_matmul_params

    v3 = AutoConfig.for_model(
        "deepseek_v3", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=129280,
    )  # fmt: skip
    default = drafter_config(v3, 5, None, 5, 16, 0)
    assert (default.num_attention_heads, default.num_key_value_heads, default.head_dim) == (128, 128, 64)
    assert layer_matmul_params(default) * 5 > 3e9
    small = drafter_config(
        v3,
        5,
        None,
        5,
        16,
        0,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
    )
    assert (small.hidden_size, small.num_attention_heads, small.num_key_value_heads) == (7168, 32, 8)
    assert (small.head_dim, small.intermediate_size) == (128, 12288)
    assert layer_matmul_params(small) * 5 < 2e9
    with pytest.raises(ValueError, match="do not split"):
        drafter_config(v3, 5, None, 5, 16, 0, num_attention_heads=32, num_key_value_heads=6)


def test_the_drafter_rope_is_read_from_every_config_form():
    """Flat rope_theta with scaling (Llama 3), one set per layer kind (Gemma 3: the full-attention
    layers'), a partial rotary factor that shapes the target's heads, not the drafter's (Qwen3-Next),
    and a target without RoPE (GPT-2), which needs drafter.rope_theta."""
    from transformers import AutoConfig

    from flashdraft.model.drafter import drafter_rope

    llama = AutoConfig.for_model(
        "llama",
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    assert drafter_rope(llama) == llama.rope_parameters  # every field: a one-axis rope type
    gemma = AutoConfig.for_model("gemma3_text")
    assert drafter_rope(gemma) == {"rope_type": "default", "rope_theta": 1e6}
    assert "partial_rotary_factor" not in drafter_rope(AutoConfig.for_model("qwen3_next"))
    with pytest.raises(ValueError, match="set drafter.rope_theta"):
        drafter_rope(AutoConfig.for_model("gpt2"))
    assert drafter_rope(AutoConfig.for_model("gpt2"), rope_theta=1e4) == {
        "rope_type": "default",
        "rope_theta": 1e4,
    }


def test_compiled_drafter_layers_share_one_graph_in_training():
    """The first layer's input (the block embeddings, from the frozen embedding) requires no grad where
    the later layers' inputs do; a compiled layer guards on that, so without care the first layer
    compiled a forward and a backward of its own (a cold start's extra seconds on the GPU)."""
    from torch._dynamo.testing import CompileCounter

    target, drafter = target_and_drafter()
    batch = packed_batch([[40, 50], [90]], seq_len=96)
    mb = plan_micro_batch(batch, 10, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0))
    blocks = mb.blocks
    vis = visibility_for(mb, BLOCK, "dense", compiled=False)
    counter = CompileCounter()
    torch._dynamo.reset()
    for layer in drafter.layers:
        layer.compile(backend=counter, dynamic=False)
    embeds = target.embed_tokens(blocks.input_ids).detach()
    hidden = drafter(embeds, blocks.positions, None, vis, target_features(target, batch), batch.position_ids)
    hidden.sum().backward()
    assert len(drafter.layers) > 1 and counter.frame_count == 1
    assert not embeds.requires_grad  # the caller's tensor is left as it was
