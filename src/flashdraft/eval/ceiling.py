"""The ceiling of deterministic drafts at T > 0: the target drafting for itself.

`generate` accepts draft k when it equals the target's token at k - 1, which at T > 0 is a sample of
softmax(logits / T). A deterministic draft d is then accepted with probability p_target(d), at most
the target's top probability, so tau at T > 0 is bounded by how peaked the target's distributions are
and not only by the drafter. What a drafter trained to predict the target's most likely tokens tends
to is the target's own greedy chain (a bound for such drafters, not for every deterministic one: a
chain through a less likely first token can hold longer runs after it): draft 1 = the target's argmax
after the verified tokens and the last token, draft 2 = its argmax after those and draft 1, and so on.
`TargetGreedyProposer` drafts that chain (B - 1 one-token forwards of the target per cycle: a
measurement, not a speed-up), so its tau at T = 1 is the ceiling a DFlash drafter of this kind
approaches under this verification; at T = 0 every draft is accepted (tau = B).

The same cycles can be read off plain decoding, for its cost (`greedy_draft_cycles`): with
the greedy chain as drafts, a drawn token is accepted exactly when it is the target's argmax there, and
the first one that is not ends the cycle as its bonus. So a cycle's length is a function of the tokens
and the target's argmax before each, and a plain decoding at T, whose tokens have the law of the
speculative ones (lossless), gives cycles of the same law as the proposer's.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from flashdraft.eval.spec import Generation, new_cache
from flashdraft.model.target import cache_argument


class TargetGreedyProposer:
    """Drafts the target's greedy continuation for `generate`, on a KV cache of its own that holds the
    verified tokens only (positions < start): drafts are run, then cropped off again.

    model: the target's HF causal LM (`Target.model`) of attention layers that can be cropped; the
    tapped features `observe` gets are not used.
    """

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = new_cache(model)
        self._cache_arg = cache_argument(model)

    def _forward(self, token_ids: torch.Tensor, start: int) -> torch.Tensor:
        """Run tokens [1, n] at positions start..start+n-1 on the cache; the last position's logits [V]."""
        if self.cache.get_seq_length() != start:
            raise RuntimeError(f"the cache holds {self.cache.get_seq_length()} tokens, expected {start}")
        positions = torch.arange(start, start + token_ids.shape[1], device=token_ids.device)[None]
        out = self.model(
            input_ids=token_ids,
            position_ids=positions,
            **{self._cache_arg: self.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    @torch.inference_mode()
    def observe(self, token_ids: torch.Tensor, features: torch.Tensor, start: int) -> None:
        self._forward(token_ids, start)

    @torch.inference_mode()
    def propose(self, last_token: torch.Tensor, start: int, num_drafts: int) -> torch.Tensor:
        token, drafts = last_token.view(1, 1), []
        for i in range(num_drafts):  # last_token and every draft but the last go through the target
            token = self._forward(token, start + i).argmax(-1).view(1, 1)
            drafts.append(token)
        self.cache.crop(start - self.cache.get_seq_length())  # back to the verified tokens
        return torch.cat(drafts, dim=1) if drafts else last_token.new_empty((1, 0))


@torch.inference_mode()
def target_argmax(model: PreTrainedModel, prompt: list[int], tokens: list[int]) -> list[int]:
    """The target's most likely token where each of `tokens` (the continuation of `prompt`) was drawn,
    from one forward over the whole sequence."""
    ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
    return model(input_ids=ids).logits[0, len(prompt) - 1 :].argmax(-1).tolist()


def greedy_draft_cycles(
    tokens: list[int], argmax: list[int], block_size: int, max_new_tokens: int
) -> Generation:
    """The cycles `generate` runs with `TargetGreedyProposer` on a decoding's `tokens` (the first from
    the prefill, as in `Generation`), argmax[j] being the target's most likely token where tokens[j] was
    drawn: a token is an accepted draft while it is the argmax and the block has drafts left; the next
    is the bonus; the last cycle ends with the tokens (at a stop token or the budget)."""
    out, j = Generation(tokens=list(tokens)), 1
    while j < len(tokens):
        size = min(block_size, max_new_tokens - j + 1)  # the verified block: last token + drafts
        drawn = tokens[j : j + size - 1]  # the tokens at the draft slots
        greedy = argmax[j : j + len(drawn)]
        accepted = next((i for i, (t, a) in enumerate(zip(drawn, greedy, strict=True)) if t != a), len(drawn))
        kept = min(accepted + 1, len(tokens) - j)
        out.accept_lengths.append(kept)
        out.verify_sizes.append(size)
        j += kept
    return out
