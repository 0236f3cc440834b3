"""Speculative sampling at T > 0 draws from the target's own distribution (lossless).

The joint distribution of the first three new tokens is computed exactly from the target (every
prefix, one batched forward) and compared with many seeded runs of the engine by a chi-square test.
The first token comes from the prefill; the second and third come from verify cycles, through both
the accepting path (the trained drafter's drafts are the target's likely tokens) and the rejecting one.
"""

from collections import Counter

import torch

from flashdraft.eval.spec import DFlashProposer, generate, sample_tokens
from test_eval_spec import tiny_setup

TEMPERATURE = 0.5
RUNS = 600


def _next_token_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids, logits_to_keep=1).logits[:, -1]
    return torch.softmax(logits.float() / TEMPERATURE, dim=-1)


def expected_first_three(model, prompt: list[int], runs: int) -> dict[tuple[int, int, int], float]:
    """Expected counts of (t1, t2, t3) in `runs` draws from the target at TEMPERATURE, for every triple
    whose (t1, t2) prefix is expected at least 5 times (no other triple can be)."""
    ids = torch.tensor([prompt])
    p1 = _next_token_probs(model, ids)[0]
    vocab = p1.shape[0]
    p2 = _next_token_probs(model, torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1))
    pairs = ((p1[:, None] * p2 * runs) >= 5).nonzero().tolist()
    prefixes = torch.tensor([prompt + pair for pair in pairs])
    p3 = _next_token_probs(model, prefixes)
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
