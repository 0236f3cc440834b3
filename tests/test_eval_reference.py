"""Against the reference `dflash` package (PyPI, z-lab): our exported checkpoint loads there, its drafter
computes the same hidden states as ours, and its decoding loop reports the same acceptance lengths and
output as our eval on the same prompts at T = 0.

The reference runs on CPU except for `return_stats=True`, whose timer calls torch.cuda.synchronize();
that timer is replaced by a plain clock here (`spec_generate`, the public call, needs no change).
dflash 0.1.0 pins tqdm/datasets/requests exactly, so it is installed with `pip install --no-deps`.
"""

import time

import pytest
import torch

from flashdraft.eval.spec import DFlashProposer, generate
from flashdraft.export.formats import export_checkpoint
from flashdraft.model.checkpoint import load_drafter, write_zlab
from flashdraft.model.drafter import Visibility
from flashdraft.model.target import Target
from test_eval_spec import tiny_setup

reference = pytest.importorskip(
    "dflash.model", reason="reference package: pip install --no-deps dflash==0.1.0"
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The trained tiny drafter exported to the z-lab layout; loaded by flashdraft and by dflash."""
    s = tiny_setup()
    root = tmp_path_factory.mktemp("reference")
    (root / "ckpt").mkdir()
    write_zlab(s.trained, root / "ckpt")
    out = export_checkpoint(root / "ckpt", "zlab", root / "zlab")
    ref, info = reference.DFlashDraftModel.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_drafter(out)
    return s, ours.eval(), ref.eval()


def test_reference_reads_the_dflash_fields_of_our_checkpoint(exported):
    _, ours, ref = exported
    assert ref.target_layer_ids == ours.target_layer_ids
    assert ref.block_size == ours.block_size
    assert ref.mask_token_id == ours.mask_token_id
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(ref.state_dict()[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("context", [1, 9, 40])
def test_reference_drafter_computes_our_hidden_states(exported, context):
    _, ours, ref = exported
    g = torch.Generator().manual_seed(context)
    hidden = ours.config.hidden_size
    features = torch.randn(1, context, len(ours.target_layer_ids) * hidden, generator=g)
    block = torch.randn(1, ours.block_size, hidden, generator=g)
    positions = torch.arange(context + ours.block_size)[None] + 3
    with torch.no_grad():
        theirs = ref(position_ids=positions, noise_embedding=block, target_hidden=features)
        ctx_kv = ours.context_kv(ours.fuse(features), positions[:, :context])
        mine = ours(block, positions[:, context:], ctx_kv, Visibility(None))
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_reference_decoding_reports_our_acceptance_lengths(exported, monkeypatch):
    s, ours, ref = exported
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its stats timer is CUDA-only
    target = Target(s.model, ours.target_layer_ids)
    lengths = []
    for i, prompt in enumerate(s.prompts):
        ids = torch.tensor([prompt])
        stops = [generate(target, ids, 40).tokens[15]] if i % 2 else None  # some runs end at a stop token
        theirs = reference.dflash_generate(ref, s.model, ids, 40, stops, temperature=0.0, return_stats=True)
        mine = generate(
            target, ids, 40, DFlashProposer(ours, target), ours.block_size, stop_token_ids=stops or ()
        )
        assert mine.accept_lengths == theirs.acceptance_lengths
        assert mine.tokens == theirs.output_ids[0, len(prompt) :].tolist()
        assert len(mine.tokens) < 40 if stops else len(mine.tokens) == 40
        public = ref.spec_generate(s.model, ids, 40, stops)
        assert public[0, len(prompt) :].tolist() == mine.tokens
        lengths += mine.accept_lengths
    assert sum(lengths) / len(lengths) > 3  # the drafter is accepted, so acceptance lengths say something


@pytest.fixture(scope="module", params=[3, 8])
def sliding(request, tmp_path_factory):
    """The trained tiny drafter with its first layer made a sliding_attention layer of `window` keys,
    exported, and loaded by both."""
    import copy

    from flashdraft.model.drafter import DFlashDrafter

    s = tiny_setup()
    config = copy.deepcopy(s.trained.config)
    config.layer_types = ["sliding_attention"] + ["full_attention"] * (config.num_hidden_layers - 1)
    config.sliding_window, config.use_sliding_window = request.param, True
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(s.trained.state_dict())
    root = tmp_path_factory.mktemp("sliding")
    (root / "ckpt").mkdir()
    write_zlab(drafter, root / "ckpt")
    out = export_checkpoint(root / "ckpt", "zlab", root / "zlab")
    ref = reference.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32)
    ours = load_drafter(out)
    assert ours.layer_types == ref.config.layer_types == config.layer_types
    assert ours.sliding_window == ref.config.sliding_window == request.param
    return s, ours.eval(), ref.eval()


@pytest.mark.parametrize("context", [1, 9, 40])
def test_a_sliding_layer_computes_the_references_hidden_states(sliding, context):
    from flashdraft.eval.static import layer_visibility

    _, ours, ref = sliding
    g = torch.Generator().manual_seed(context)
    hidden = ours.config.hidden_size
    features = torch.randn(1, context, len(ours.target_layer_ids) * hidden, generator=g)
    block = torch.randn(1, ours.block_size, hidden, generator=g)
    positions = torch.arange(context + ours.block_size)[None]
    with torch.no_grad():
        theirs = ref(position_ids=positions, noise_embedding=block, target_hidden=features)
        ctx_kv = ours.context_kv(ours.fuse(features), positions[:, :context])
        vis = layer_visibility(ours, None, positions[0], positions[0, context:])
        mine = ours(block, positions[:, context:], ctx_kv, vis)
        with pytest.raises(ValueError, match="a visibility per layer type"):
            ours(block, positions[:, context:], ctx_kv, Visibility(None))
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_a_sliding_drafter_decodes_with_the_references_acceptance(sliding, monkeypatch):
    s, ours, ref = sliding
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    target = Target(s.model, ours.target_layer_ids)
    for prompt in s.prompts:
        ids = torch.tensor([prompt])
        theirs = reference.dflash_generate(ref, s.model, ids, 40, None, temperature=0.0, return_stats=True)
        mine = generate(target, ids, 40, DFlashProposer(ours, target), ours.block_size)
        assert mine.accept_lengths == theirs.acceptance_lengths
        assert mine.tokens == theirs.output_ids[0, len(prompt) :].tolist()


def test_a_sliding_drafter_decodes_alike_on_fixed_shape_caches(sliding):
    """The CUDA-graph path (fixed buffers, a mask of the filled prefix; eager on a CPU) restricts the
    sliding layer as the dynamic path does."""
    from flashdraft.eval.spec import run_methods

    s, ours, _ = sliding
    target = Target(s.model, ours.target_layer_ids)
    prompts = s.prompts[:3]
    runs = [
        run_methods(target, ours, prompts, 32, ours.block_size, 0.0, (), 0, None, graphs)
        for graphs in (False, True)
    ]
    dynamic, static = (r["dflash"] for r in runs)
    assert [g.tokens for g in static] == [g.tokens for g in dynamic]
    assert [g.accept_lengths for g in static] == [g.accept_lengths for g in dynamic]


def test_the_real_target_flow_sets_the_reference_package_beside_our_eval(tiny_target_dir, tmp_path):
    """The proof's reference stage (flashdraft.demo.real_target): our checkpoint exported, decoded by
    the reference package on chat prompts, each prompt's tau set against ours."""
    import dataclasses

    from flashdraft.demo.real_target import CPU, reference_on_prompts
    from flashdraft.eval.report import compare_methods
    from flashdraft.model.checkpoint import write_zlab
    from flashdraft.model.drafter import DFlashDrafter, drafter_config
    from flashdraft.model.target import load_target
    from flashdraft.train.build import init_drafter_

    model, _ = load_target(tiny_target_dir)
    drafter = DFlashDrafter(drafter_config(model.config, 1, None, 2, 8, 3))
    init_drafter_(drafter, 0.1, seed=0)
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter, tmp_path / "ckpt")
    records = [{"messages": [{"role": "user", "content": t}]} for t in ("def main():", "import os", "x = 1")]
    scale = dataclasses.replace(CPU, eval_tokens=12)
    report = compare_methods(
        tiny_target_dir, tmp_path / "ckpt", [r["messages"] for r in records], 12, device="cpu"
    )
    ours = report["dflash"]["tau_per_sample"]
    ref = reference_on_prompts(tmp_path / "ckpt", tiny_target_dir, tmp_path, records, scale, ours)
    assert ref["samples_with_our_tau"] == 3 and ref["tau"] == pytest.approx(ref["our_tau"])
    assert (tmp_path / "export" / "zlab" / "config.json").is_file()


def test_eval_reference_sets_the_reference_package_beside_our_tau(tiny_target_dir, tmp_path):
    """`flashdraft eval --reference`: the same prompts decoded by the reference package on the export,
    its tau in the report beside ours, prompt by prompt."""
    import json

    from typer.testing import CliRunner

    from flashdraft.cli.main import app
    from flashdraft.model.checkpoint import write_zlab
    from flashdraft.model.drafter import DFlashDrafter, drafter_config
    from flashdraft.model.target import load_target
    from flashdraft.train.build import init_drafter_

    model, _ = load_target(tiny_target_dir)
    drafter = DFlashDrafter(drafter_config(model.config, 1, None, 2, 8, 3))
    init_drafter_(drafter, 0.1, seed=0)
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter, tmp_path / "ckpt")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("def main():", "import os")))
    args = ["eval", "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "ckpt")]
    args += ["--prompts", str(prompts), "--max-new-tokens", "12", "--device", "cpu", "--reference"]
    sampled = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "r1.json"), "--temperature", "1"])
    assert sampled.exit_code == 2 and "--temperature 0" in sampled.output
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    ref = report["reference"]
    assert ref["tau_per_sample"] == pytest.approx(report["dflash"]["tau_per_sample"])
    assert ref["samples_with_our_tau"] == 2
    assert "equal on 2 of 2 prompts" in result.output


def test_acceptance_lengths_agree_to_the_digits_a_report_keeps():
    """A report keeps seven significant digits: 10.052631... is stored as 10.05263 and still agrees; a
    cycle more or less does not."""
    from flashdraft.eval.reference import agreeing

    theirs = [10.052631578947368, 2.581081081081081, 7.64, 4.5]
    assert agreeing(theirs, [10.05263, 2.581081, 7.64, 4.5 * 19 / 20]) == 3
