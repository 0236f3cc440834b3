"""Prompt-lookup (n-gram) drafting: the baseline a trained drafter has to beat.

Drafts are copied from the sequence itself: find the first earlier occurrence of the sequence's
last n tokens (n from `max_ngram` down to `min_ngram`) in prompt + output and propose the tokens
that followed it, as transformers' prompt-lookup decoding does (the first occurrence leaves the
longest continuation; the latest one is often cut short by the end of the sequence). It runs
through the same verification loop as DFlash (`flashdraft.eval.spec.generate`), so a drafter whose
tau is not above this one has learned no more than copying. A few lines of Python are enough here;
a library would add nothing.
"""

from __future__ import annotations

import torch


def lookup(sequence: list[int], num_drafts: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `num_drafts` tokens that followed the first earlier match of the sequence's suffix."""
    if num_drafts < 1:
        return []
    for n in range(min(max_ngram, len(sequence) - 1), min_ngram - 1, -1):
        suffix = sequence[-n:]
        for i in range(len(sequence) - n):
            if sequence[i : i + n] == suffix:
                return sequence[i + n : i + n + num_drafts]
    return []


class NgramProposer:
    """Drafts for `generate` by prompt lookup; target features are not used."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []

    def observe(self, token_ids: torch.Tensor, features: torch.Tensor, start: int) -> None:
        # verified tokens arrive in order, so their positions are implicit
        self.history.extend(token_ids[0].tolist())

    def propose(self, last_token: torch.Tensor, start: int, num_drafts: int) -> torch.Tensor:
        drafts = lookup(self.history + [int(last_token)], num_drafts, self.max_ngram, self.min_ngram)
        return torch.tensor([drafts], dtype=torch.long, device=last_token.device)
