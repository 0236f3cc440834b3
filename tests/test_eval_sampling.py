"""Speculative sampling at T > 0 draws from the target's own distribution (lossless).

The joint distribution of the first three new tokens is computed exactly from the target (every
prefix, one batched forward) and compared with many seeded runs of the engine by a chi-square test.
The first token comes from the prefill; the second and third come from verify cycles, through both
the accepting path (the trained drafter's drafts are the target's likely tokens) and the rejecting one.
Sampled drafts, which carry their proposal q, are tested the same way, and their rejection step alone
against a fixed target distribution.
"""

import math
from collections import Counter

import pytest
import torch

from flashdraft.eval.spec import (
    DFlashProposer,
    Proposal,
    generate,
    sample_tokens,
    sampling_probs,
    speculative_sample,
)
from flashdraft.model.dflash2 import gumbel_max
from test_eval_spec import tiny_setup

TEMPERATURE = 0.5
RUNS = 600


def _next_token_probs(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids, logits_to_keep=1).logits[:, -1]
    return sampling_probs(logits, temperature)


def expected_first_three(
    model, prompt: list[int], runs: int, temperature: float = TEMPERATURE
) -> dict[tuple[int, int, int], float]:
    """Expected counts of (t1, t2, t3) in `runs` draws from the target at `temperature`, for every triple
    whose (t1, t2) prefix is expected at least 5 times (no other triple can be)."""
    ids = torch.tensor([prompt])
    p1 = _next_token_probs(model, ids, temperature)[0]
    vocab = p1.shape[0]
    prefixes = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
    p2 = _next_token_probs(model, prefixes, temperature)
    pairs = ((p1[:, None] * p2 * runs) >= 5).nonzero().tolist()
    prefixes = torch.tensor([prompt + pair for pair in pairs])
    p3 = _next_token_probs(model, prefixes, temperature)
    return {
        (a, b, c): float(p1[a] * p2[a, b] * p3[i, c] * runs)
        for i, (a, b) in enumerate(pairs)
        for c in range(vocab)
    }


def chi_square_p_value(observed: Counter, expected: dict, runs: int, min_expected: float = 5.0) -> float:
    """Pearson's test over the cells expected at least `min_expected` times, every other cell pooled."""
    cells = [c for c, e in expected.items() if e >= min_expected]
    obs = torch.tensor(
        [observed[c] for c in cells] + [runs - sum(observed[c] for c in cells)], dtype=torch.float64
    )
    exp = torch.tensor(
        [expected[c] for c in cells] + [runs - sum(expected[c] for c in cells)], dtype=torch.float64
    )
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((len(cells)) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def test_speculative_sampling_matches_the_targets_distribution():
    s = tiny_setup()
    prompt = s.prompts[0]
    expected = expected_first_three(s.model, prompt, RUNS)
    observed = Counter()
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([prompt])
    accepted = 0
    for _ in range(RUNS):
        out = generate(s.target, ids, 3, DFlashProposer(s.trained, s.target), 8, TEMPERATURE, generator=g)
        observed[tuple(out.tokens)] += 1
        accepted += sum(a - 1 for a in out.accept_lengths)
    assert accepted > RUNS // 4  # drafts were accepted often: the accepting path is under test
    assert sum(e >= 5 for e in expected.values()) > 15  # enough separate cells for the test to have power
    p = chi_square_p_value(observed, expected, RUNS)
    assert p > 1e-3, p


def test_temperature_zero_is_argmax_and_positive_temperature_samples():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    assert sample_tokens(logits, 0.0, None).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_tokens(logits, 1.0, g) for _ in range(2000)])
    freq = (draws[:, 0] == 1).double().mean()
    assert abs(freq - torch.softmax(logits[0], 0)[1]) < 0.03


# ---- sampled drafts: proposals that carry q ------------------------------------------------------

P = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])  # the target's distribution at the draft's slot
TRIALS = 4000


def tv_tolerance(p: torch.Tensor, runs: int, failure: float = 1e-3) -> float:
    """A total variation distance between `runs` draws of `p` and `p` that is exceeded with probability
    below `failure`: its mean is at most sum_i sqrt(p_i (1 - p_i) / runs) / 2 (Jensen), and as one draw
    moves it by at most 1 / runs, McDiarmid's inequality adds sqrt(ln(1 / failure) / (2 runs))."""
    mean = float((p * (1 - p)).sqrt().sum()) / (2 * math.sqrt(runs))
    return mean + math.sqrt(math.log(1 / failure) / (2 * runs))


@pytest.mark.parametrize(
    ("q", "support"),
    [
        # over the vocabulary: more mass than p on 2 and 3, mass on 4 where p has none, none on 5
        (torch.tensor([0.05, 0.1, 0.25, 0.3, 0.3, 0.0]), None),
        # over candidates 3, 4, 0 (DFlash2's form): p has mass on 1 and 2 outside them, none on 4
        (torch.tensor([0.5, 0.3, 0.2]), torch.tensor([3, 4, 0])),
    ],
    ids=["vocabulary", "candidates"],
)
def test_rejection_step_emits_the_targets_distribution(q, support):
    """A draft x ~ q, then accept with min(1, p(x) / q(x)) or resample from the residual: the first
    emitted token has law p whatever q is (against p itself, a wrong residual is off by TV 0.15)."""
    g = torch.Generator().manual_seed(0)
    p = torch.stack([P, P])  # row 1: the bonus slot after the one draft
    counts = torch.zeros(len(P))
    for _ in range(TRIALS):
        i = torch.multinomial(q, 1, generator=g)
        draft = i if support is None else support[i]
        proposal = Proposal(draft[None], q[None, None], None if support is None else support[None, None])
        counts[speculative_sample(p, proposal, g)[0]] += 1
    assert counts[P == 0].sum() == 0  # never a token the target cannot emit
    tv = 0.5 * float((counts / TRIALS - P).abs().sum())
    assert tv < tv_tolerance(P, TRIALS), tv


def test_gumbel_max_draws_softmax_of_its_scores():
    """Sampled drafts come from uniform noise by the Gumbel-max trick (so that they replay in a CUDA
    graph): 20,000 draws of one row of scores have the law softmax(scores); a sign error in -log(-log U)
    or a sample of the scores' argmax is off by TV above 0.3."""
    scores = torch.tensor([2.0, 1.0, 0.5, -1.0, -30.0, 0.0])
    runs = 20_000
    noise = torch.rand(runs, len(scores), generator=torch.Generator().manual_seed(0))
    picks = gumbel_max(scores.expand(runs, -1), noise)
    p = torch.softmax(scores, -1)
    tv = 0.5 * float((torch.bincount(picks, minlength=len(scores)) / runs - p).abs().sum())
    assert tv < tv_tolerance(p, runs), tv


class TopCandidates(DFlashProposer):
    """Sampled drafts over the drafter's top-k candidates, the form of DFlash2's selector (less its
    pairwise scores): q over [1, n, k] candidate ids, zero on the rest of the vocabulary."""

    def propose(self, last_token: torch.Tensor, start: int, num_drafts: int) -> Proposal:
        scores, candidates = self.logits(last_token, start, num_drafts).topk(4, dim=-1)
        q = sampling_probs(scores, self.temperature)
        picked = torch.multinomial(q, 1, generator=self.generator)
        return Proposal(candidates.gather(-1, picked).T, q[None], candidates[None])


SAMPLED_RUNS = 600


def sampled_first_three(target, prompt: list[int], proposer, runs: int = SAMPLED_RUNS) -> tuple[Counter, int]:
    """Counts of the first three new tokens over `runs` seeded T = 1 decodings with `proposer(generator)`,
    and the drafts accepted in all of them."""
    observed = Counter()
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([prompt])
    accepted = 0
    for _ in range(runs):
        out = generate(target, ids, 3, proposer(g), 8, 1.0, generator=g)
        observed[tuple(out.tokens)] += 1
        accepted += sum(a - 1 for a in out.accept_lengths)
    return observed, accepted


@pytest.mark.parametrize("proposer", [DFlashProposer, TopCandidates], ids=["vocabulary", "candidates"])
def test_sampled_drafts_decode_the_targets_distribution(proposer):
    """At T = 1 the first three new tokens of speculative decoding with sampled drafts (q over the
    vocabulary, or over top-k candidates) have the law of plain sampling from the target."""
    s = tiny_setup()
    prompt = s.prompts[0]
    expected = expected_first_three(s.model, prompt, SAMPLED_RUNS, temperature=1.0)
    observed, accepted = sampled_first_three(
        s.target, prompt, lambda g: proposer(s.trained, s.target, 1.0, g)
    )
    assert accepted > SAMPLED_RUNS // 10  # both the accepting and the residual path ran
    p = chi_square_p_value(observed, expected, SAMPLED_RUNS)
    assert p > 1e-3, p


def test_sampled_proposals_at_temperature_zero_decode_greedily():
    """At T = 0 the target's distribution is one-hot, so drafts that carry q give the greedy output."""
    s = tiny_setup()
    g = torch.Generator().manual_seed(0)
    for proposer in (DFlashProposer, TopCandidates):
        for prompt in s.prompts[:2]:
            ids = torch.tensor([prompt])
            spec = generate(s.target, ids, 24, proposer(s.trained, s.target, 1.0, g), 8, generator=g)
            assert spec.tokens == generate(s.target, ids, 24).tokens
