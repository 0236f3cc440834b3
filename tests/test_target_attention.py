"""`train.target_attention: auto`: the target's attention for packed rows chosen by measurement
(flashdraft.train.target_attention). Timings are the machine's, so the choice's rule is tested with
given timings; one test measures for real on a tiny target."""

import json

import pytest
import torch

from flashdraft.model.target import Target, load_target
from flashdraft.train import target_attention as ta


def packed_batch(vocab: int, rows: int = 2, documents: int = 3, length: int = 16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, documents * length), generator=g)
    positions = torch.arange(length).repeat(documents).expand(rows, -1).clone()
    return ids, positions


@pytest.fixture
def target(tiny_target_dir):
    model, _ = load_target(tiny_target_dir, "cpu")
    return Target(model, [0, 1])


def test_measured_for_real_keeps_the_features_and_sets_the_choice(target, tmp_path):
    ids, positions = packed_batch(target.config.vocab_size)
    before = target.features(ids, positions)
    choice = ta.choose_target_attention(target, ids, positions, tmp_path, ("sdpa", "eager"), repeats=2)
    assert set(choice.ms) == {"sdpa", "eager"} and choice.name == min(choice.ms, key=choice.ms.get)
    assert target.model.config._attn_implementation == choice.name
    torch.testing.assert_close(target.features(ids, positions), before, atol=1e-5, rtol=1e-5)
    assert "measured on the first batch" in choice.line()


def test_the_fastest_is_kept_and_remembered(target, tmp_path, monkeypatch):
    ids, positions = packed_batch(target.config.vocab_size)
    timings = iter([3.0, 1.0])  # sdpa, then eager
    monkeypatch.setattr(ta, "_median_ms", lambda forward, repeats: (next(timings), forward()))
    choice = ta.choose_target_attention(target, ids, positions, tmp_path, ("sdpa", "eager"))
    assert (choice.name, choice.ms) == ("eager", {"sdpa": 3.0, "eager": 1.0})
    assert target.model.config._attn_implementation == "eager"

    target.model.set_attn_implementation("sdpa")
    monkeypatch.setattr(ta, "_median_ms", lambda *a: pytest.fail("measured again"))
    again = ta.choose_target_attention(target, ids, positions, tmp_path, ("sdpa", "eager"))
    assert again.remembered and again.name == "eager" and "measured earlier" in again.line()
    assert target.model.config._attn_implementation == "eager"
    # another batch shape is another measurement
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        ta.choose_target_attention(target, *packed_batch(target.config.vocab_size, documents=2), tmp_path,
                                   ("sdpa", "eager"))  # fmt: skip


def test_a_candidate_under_which_documents_leak_is_refused(target, tmp_path, monkeypatch):
    ids, positions = packed_batch(target.config.vocab_size)
    monkeypatch.setattr(ta, "_median_ms", lambda forward, repeats: (1.0, forward()))
    monkeypatch.setattr(target, "leaks", lambda packing: target.model.config._attn_implementation == "eager")
    choice = ta.choose_target_attention(target, ids, positions, None, ("eager", "sdpa"))
    assert choice.name == "sdpa" and "eager" not in choice.ms
    assert "see each other" in choice.refused["eager"] and "eager refused" in choice.line()

    monkeypatch.setattr(target, "leaks", lambda packing: True)
    with pytest.raises(ValueError, match="no candidate runs packed rows"):
        ta.choose_target_attention(target, ids, positions, None, ("eager", "sdpa"))
    assert target.model.config._attn_implementation == "sdpa"  # as it was


def test_a_candidate_that_fails_to_run_is_refused_with_its_reason_and_the_models_own_stays_in(
    target, monkeypatch
):
    """A kernel that cannot compile for the model (gpt-oss's sinks under flex_attention on torch 2.11)
    refuses that candidate, not the run; the model's own attention is always a candidate."""
    ids, positions = packed_batch(target.config.vocab_size)
    features = target.features

    def failing(*args, **kwargs):
        if target.model.config._attn_implementation == "eager":
            raise RuntimeError("cannot lower the score mod\nmore")
        return features(*args, **kwargs)

    monkeypatch.setattr(target, "features", failing)
    choice = ta.choose_target_attention(target, ids, positions, None, ("eager",), repeats=1)
    assert choice.name == "sdpa" and list(choice.ms) == ["sdpa"]
    assert choice.refused == {"eager": "RuntimeError: cannot lower the score mod"}


def test_a_damaged_cache_is_measured_again(target, tmp_path, monkeypatch):
    ids, positions = packed_batch(target.config.vocab_size)
    (tmp_path / ta.CACHE_FILE).write_text("{not json")
    monkeypatch.setattr(ta, "_median_ms", lambda forward, repeats: (2.0, forward()))
    choice = ta.choose_target_attention(target, ids, positions, tmp_path, ("sdpa",))
    assert not choice.remembered and choice.name == "sdpa"
    assert list(json.loads((tmp_path / ta.CACHE_FILE).read_text()).values())[0]["name"] == "sdpa"


def test_a_run_measures_on_its_first_packed_batch_and_every_target_rank_takes_the_main_ranks_choice(
    target, tmp_path, monkeypatch
):
    """build's wiring (on a GPU by default; the CPU allowed here): packed rows are measured, rows of one
    document are not, and a rank takes what the main rank chose."""
    from types import SimpleNamespace

    from flashdraft.config import resolve_config
    from flashdraft.data.packing import PackedBatch
    from flashdraft.train import build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cfg = resolve_config("default")
    ids, positions = packed_batch(target.config.vocab_size)
    docs = torch.arange(3).repeat_interleave(16).expand_as(ids).clone()
    packed = [PackedBatch(ids, torch.ones_like(ids), positions, docs)]
    chosen = []
    monkeypatch.setattr(ta, "choose_target_attention", lambda t, i, p, cache: chosen.append(cache)
                        or ta.AttentionChoice("eager", {"eager": 1.0, "sdpa": 2.0}))  # fmt: skip
    topo = SimpleNamespace(device=torch.device("cpu"), target_group=None, is_target=True, is_main=True,
                           gather_objects=lambda obj: ["sdpa", obj])  # fmt: skip
    build.measure_target_attention(cfg, target, packed, topo, devices=("cpu",))
    assert len(chosen) == 1 and target.model.config._attn_implementation == "sdpa"  # the main rank's

    topo.gather_objects = lambda obj: [obj]
    build.measure_target_attention(cfg, target, packed, topo, devices=("cpu",))
    assert len(chosen) == 2 and target.model.config._attn_implementation == "eager"

    one = torch.arange(ids.shape[1]).expand_as(ids).clone()
    build.measure_target_attention(cfg, target, [PackedBatch(ids, ids, one, one * 0)], topo, ("cpu",))
    build.measure_target_attention(cfg, target, packed, topo)  # on a CPU by default: not measured
    assert len(chosen) == 2


def test_a_few_tokens_far_off_are_rounding_and_many_are_a_wrong_kernel():
    """bf16 rounding moves a few tokens' features far (a real model: up to 0.25 of their size between
    sdpa and eager attention); a wrong mask or window moves many."""
    g = torch.Generator().manual_seed(0)
    own = torch.randn(2, 50, 32, generator=g)
    few, many = own.clone(), own.clone()
    few[:, :4] *= 1.5  # 8% of the tokens half their size off
    many[:, :15] *= 1.5  # 30%
    assert ta._difference(few, own) < ta.AGREE < ta._difference(many, own)
