"""The target drafting for itself (flashdraft.eval.ceiling): at T = 0 every draft is accepted, at T = 1
its drafts are the target's greedy chain after exactly the verified tokens, whatever was rejected, and
its cycles are the ones read off its tokens and the target's argmax before each."""

from functools import lru_cache
from types import SimpleNamespace

import torch

from flashdraft.eval.ceiling import TargetGreedyProposer, greedy_draft_cycles, target_argmax
from flashdraft.eval.spec import generate
from flashdraft.model.target import Target
from helpers import BLOCK, VOCAB, tiny_target

NEW_TOKENS = 4 * BLOCK + 4  # a last cycle shorter than the block


@lru_cache(maxsize=1)
def setup() -> SimpleNamespace:
    model = tiny_target()
    # a random lm_head at init scale gives near-flat distributions, where nothing is accepted at T = 1
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (10, 3, 17)]
    return SimpleNamespace(model=model, target=Target(model, [1, 3]), prompts=prompts)


class Recording:
    """A proposer that remembers every proposal: (start, last token, drafts)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, int, list[int]]] = []

    def observe(self, token_ids, features, start):
        self.inner.observe(token_ids, features, start)

    def propose(self, last_token, start, num_drafts):
        drafts = self.inner.propose(last_token, start, num_drafts)
        self.calls.append((start, int(last_token), drafts[0].tolist()))
        return drafts


@torch.inference_mode()
def greedy_from_scratch(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids`, each from a whole forward of the sequence so far (no cache)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:] if n else []


def test_at_t0_the_target_drafting_for_itself_is_accepted_whole_and_decodes_as_plain_decoding():
    s = setup()
    for p in s.prompts:
        ids = torch.tensor([p])
        plain = generate(s.target, ids, NEW_TOKENS)
        spec = generate(s.target, ids, NEW_TOKENS, TargetGreedyProposer(s.model), BLOCK)
        assert spec.tokens == plain.tokens
        # the first token comes from the prefill, the last cycle keeps what is left of the budget
        assert spec.accept_lengths == [BLOCK] * 4 + [3]


def test_at_t1_drafts_are_the_greedy_chain_after_the_verified_tokens():
    s = setup()
    rejected = accepted = 0
    for i, p in enumerate(s.prompts):
        ids = torch.tensor([p])
        runs = []
        for _ in range(2):  # the same seed, the same sample
            proposer = Recording(TargetGreedyProposer(s.model))
            gen = torch.Generator().manual_seed(i)
            out = generate(s.target, ids, NEW_TOKENS, proposer, BLOCK, 1.0, generator=gen)
            runs.append(out)
        assert runs[0].tokens == runs[1].tokens and runs[0].accept_lengths == runs[1].accept_lengths
        assert len(out.tokens) == NEW_TOKENS and out.tau >= 1
        assert proposer.inner.cache.get_seq_length() == len(p) + NEW_TOKENS - 1  # all verified, no drafts
        sequence = p + out.tokens
        for start, last, drafts in proposer.calls:
            assert sequence[start] == last
            assert drafts == greedy_from_scratch(s.model, sequence[: start + 1], len(drafts))
        accepted += sum(a - 1 for a in out.accept_lengths)
        rejected += sum(a < v for a, v in zip(out.accept_lengths, out.verify_sizes, strict=True))
    assert accepted > 0 and rejected > 0  # both kinds of cycle were checked


def test_cycles_read_off_the_tokens_are_the_proposers():
    """greedy_draft_cycles on the proposer's own output and the target's argmax gives its cycles exactly
    (at T = 1, where the bonus of a rejecting cycle is never the argmax), ended by a stop token too."""
    s = setup()
    for i, p in enumerate(s.prompts[:2]):
        ids = torch.tensor([p])
        full = generate(s.target, ids, NEW_TOKENS, TargetGreedyProposer(s.model), BLOCK, 1.0,
                        generator=torch.Generator().manual_seed(i))  # fmt: skip
        stop = next(t for j, t in enumerate(full.tokens) if j >= 12 and t not in full.tokens[:j])
        cut = generate(s.target, ids, NEW_TOKENS, TargetGreedyProposer(s.model), BLOCK, 1.0, [stop],
                       torch.Generator().manual_seed(i))  # fmt: skip
        assert cut.tokens == full.tokens[: full.tokens.index(stop) + 1]
        for out in (full, cut):
            walk = greedy_draft_cycles(out.tokens, target_argmax(s.model, p, out.tokens), BLOCK, NEW_TOKENS)
            assert walk.accept_lengths == out.accept_lengths
            assert walk.verify_sizes == out.verify_sizes
