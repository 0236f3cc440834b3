"""DFlash2 in the decode loop: at T = 0 its selector's best path is verified greedily (the output is the
target's greedy output, the acceptance the reference package's, alike on fixed-shape caches); at T > 0 it
samples a path and each draft carries its q over the candidates, and the decoded tokens follow the
target's distribution."""

import pytest
import torch

from flashdraft.eval.reference import reference_tau
from flashdraft.eval.spec import DFlashProposer, generate, resolve_draft_sampling, run_methods
from flashdraft.export.formats import export_checkpoint
from flashdraft.model.checkpoint import load_drafter, write_zlab
from flashdraft.model.dflash2 import DFlash2Settings
from flashdraft.model.target import Target, load_target
from flashdraft.train.build import dflash2_from_dflash
from test_eval_sampling import SAMPLED_RUNS, chi_square_p_value, expected_first_three, sampled_first_three
from test_eval_spec import tiny_setup

# sizes for the tiny target (width 32, a vocabulary of 96)
SETTINGS = DFlash2Settings(
    conv_kernel_size=2,
    conv_group_size=8,
    selector_rank=6,
    selector_top_k=4,
    output_multiplier=1.0,
    final_logit_softcapping=None,
)


def moved_off_dflash(trained, settings: DFlash2Settings = SETTINGS):
    """A trained DFlash drafter made DFlash2 (drafting as it), then its convolutions and selector moved off
    that start, so that the selector's path differs from the logits' argmax somewhere."""
    drafter = dflash2_from_dflash(trained, settings, std=0.02, seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.add_(torch.randn(p.shape, generator=g) * (0.2 if "selector" in name else 0.01))
    return drafter.eval()


@pytest.fixture(scope="module")
def setup():
    """The trained tiny DFlash drafter made DFlash2 and moved off that start (`moved_off_dflash`)."""
    s = tiny_setup()
    drafter = moved_off_dflash(s.trained)
    s.dflash2 = drafter
    s.target = Target(s.model, drafter.target_layer_ids)
    return s


def test_dflash2_greedy_decoding_is_the_targets_greedy_output_and_follows_the_selector(setup):
    s = setup
    moved = 0
    for prompt in s.prompts[:3]:
        ids = torch.tensor([prompt])
        proposer = DFlashProposer(s.dflash2, s.target)
        out = generate(s.target, ids, 40, proposer, s.dflash2.block_size)
        assert out.tokens == generate(s.target, ids, 40).tokens
        assert out.tau > 1.5  # drafts are accepted: the comparison says something
        with torch.no_grad():
            hidden = proposer.hidden(torch.tensor([out.tokens[0]]), len(prompt), 7)
            path = proposer.propose(torch.tensor([out.tokens[0]]), len(prompt), 7).tokens
        moved += not torch.equal(path, s.dflash2.logits(hidden, s.model.lm_head).argmax(-1))
    assert moved  # the selector, not the argmax, chose the drafts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dflash2_decodes_alike_on_fixed_shape_caches(setup, temperature):
    """The fixed-shape path (CUDA graphs on a GPU, run eagerly here): the best path at T = 0, and at T = 1
    the same sampled selector paths, drawn outside the graph with each prompt's generator."""
    s = setup
    runs = [
        run_methods(
            s.target, s.dflash2, s.prompts[:3], 32, s.dflash2.block_size, temperature, (), 0, None, graphs
        )
        for graphs in (False, True)
    ]
    dynamic, static = (r["dflash"] for r in runs)
    assert [g.tokens for g in static] == [g.tokens for g in dynamic]
    assert [g.accept_lengths for g in static] == [g.accept_lengths for g in dynamic]


def test_reference_package_decodes_our_dflash2_export_with_our_acceptance(setup, tmp_path, monkeypatch):
    reference = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    import time

    s = setup
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its stats timer is CUDA-only
    (tmp_path / "ckpt").mkdir()
    write_zlab(s.dflash2, tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", "zlab", tmp_path / "zlab")
    ref = reference.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_drafter(out).eval()
    for prompt in s.prompts[:3]:
        ids = torch.tensor([prompt])
        theirs = reference.dflash_generate(ref, s.model, ids, 40, None, temperature=0.0, return_stats=True)
        mine = generate(s.target, ids, 40, DFlashProposer(ours, s.target), ours.block_size)
        assert mine.accept_lengths == theirs.acceptance_lengths
        assert mine.tokens == theirs.output_ids[0, len(prompt) :].tolist()


def test_eval_reference_loads_a_dflash2_export_as_dflash2(tmp_path, tiny_target_dir, monkeypatch):
    """`flashdraft eval --reference` (reference_tau) decodes a DFlash2 export with the reference's DFlash2
    class, prompt by prompt at our tau: with its DFlash class the selector would be ignored."""
    pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    from transformers import AutoConfig

    from flashdraft.model.drafter import DFlashDrafter, drafter_config
    from flashdraft.train.build import init_drafter_

    config = drafter_config(AutoConfig.from_pretrained(tiny_target_dir), 2, None, 2, 8, 3,
                            dflash2=DFlash2Settings(2, 16, 8, 4, 1.0, None))  # fmt: skip
    drafter = DFlashDrafter(config)
    init_drafter_(drafter, std=0.1, seed=0)
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 3.0)  # the selector decides
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter, tmp_path / "ckpt")
    export = export_checkpoint(tmp_path / "ckpt", "zlab", tmp_path / "zlab")
    model, _ = load_target(tiny_target_dir, "cpu")
    target = Target(model, drafter.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (12,), generator=g).tolist() for _ in range(3)]
    ours = [
        generate(target, torch.tensor([p]), 24, DFlashProposer(drafter.eval(), target), 8).tau
        for p in prompts
    ]
    assert reference_tau(export, tiny_target_dir, prompts, 24, "cpu")["tau_per_sample"] == pytest.approx(ours)


def test_dflash2_drafts_by_sampling_its_path_at_t_above_0_unless_told_otherwise(setup):
    s = setup
    assert resolve_draft_sampling("auto", s.dflash2, 1.0) == "sample"
    assert resolve_draft_sampling("auto", s.dflash2, 0.0) == "argmax"
    assert resolve_draft_sampling("auto", s.trained, 1.0) == "argmax"
    assert resolve_draft_sampling("argmax", s.dflash2, 1.0) == "argmax"
    proposer = DFlashProposer(s.dflash2, s.target, 1.0, torch.Generator().manual_seed(0))
    seen = []
    propose = proposer.propose
    proposer.propose = lambda *a: seen.append(propose(*a)) or seen[-1]
    generate(s.target, torch.tensor([s.prompts[0]]), 12, proposer, 8, 1.0, generator=torch.Generator())
    assert seen and all(p.q is not None and p.support.shape[-1] == SETTINGS.selector_top_k for p in seen)
    assert all((p.support == p.tokens[..., None]).any(-1).all() for p in seen)  # each draft a candidate


def test_dflash2_sampled_paths_decode_the_targets_distribution(setup):
    """At T = 1 the first three new tokens of DFlash2 decoding (the selector's path sampled, each draft
    verified with its q over the candidates) have the law of plain sampling from the target."""
    s = setup
    prompt = s.prompts[0]
    expected = expected_first_three(s.model, prompt, SAMPLED_RUNS, temperature=1.0)
    observed, accepted = sampled_first_three(
        s.target, prompt, lambda g: DFlashProposer(s.dflash2, s.target, 1.0, g)
    )
    assert accepted > SAMPLED_RUNS // 10  # both the accepting and the residual path ran
    assert chi_square_p_value(observed, expected, SAMPLED_RUNS) > 1e-3
