"""What DFlash2 adds to the DFlash drafter (docs/dflash.md, DFlash2): a grouped dynamic causal convolution
around each attention and MLP sublayer, a low-rank candidate selector that walks the block's top-k
candidates into one coherent path of drafts, and a multiplier and tanh cap on the lm_head logits.

Hand-written from the maths of the reference package (`dflash/model.py`, 0.1.0: `GroupedDynamicCausalConv`,
`CandidateSelector`, `compute_logits`), with its parameter names and shapes, so that its checkpoints load
here and ours there. Two differences, both invisible to a reference checkpoint:
- The convolution restarts at every block start (chunks of `block_size` along the queries, the last one
  possibly shorter). The reference's forward only ever holds one block; our training forward holds many
  blocks in a row, and a position must not mix with a neighbouring block.
- The selector orders its candidates by logit and samples with an optional torch.Generator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DFlash2Settings:
    """DFlash2's sizes, as `dflash_config` of a z-lab config.json holds them."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float
    final_logit_softcapping: float | None

    @classmethod
    def of(cls, config) -> DFlash2Settings | None:
        """The settings a drafter config carries (`config.dflash2`); None for a DFlash drafter."""
        fields = getattr(config, "dflash2", None)
        return cls(**fields) if fields else None

    @classmethod
    def missing(cls, dflash_config: dict) -> list[str]:
        """The settings a z-lab `dflash_config` lacks (final_logit_softcapping may be absent: no cap)."""
        names = cls.__dataclass_fields__
        return [k for k in names if k not in dflash_config and k != "final_logit_softcapping"]

    @classmethod
    def from_dflash_config(cls, dflash_config: dict) -> DFlash2Settings:
        return cls(**{k: dflash_config.get(k) for k in cls.__dataclass_fields__})

    def as_dict(self) -> dict:
        return asdict(self)

    def problems(self, hidden_size: int, vocab_size: int, prefix: str = "") -> list[str]:
        """What keeps these settings from a drafter of this width and vocabulary (names after `prefix`)."""
        out = [
            f"{prefix}{name} must be a positive integer, got {getattr(self, name)!r}"
            for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1
        ]
        if out:
            return out
        if hidden_size % self.conv_group_size:
            out.append(
                f"{prefix}conv_group_size {self.conv_group_size} does not divide the drafter's width "
                f"{hidden_size} (the target's hidden size)"
            )
        if self.selector_top_k > vocab_size:
            out.append(f"{prefix}selector_top_k {self.selector_top_k} exceeds the vocabulary ({vocab_size})")
        if not self.output_multiplier > 0:
            out.append(f"{prefix}output_multiplier must be > 0, got {self.output_multiplier!r}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping >= 0:
            out.append(f"{prefix}final_logit_softcapping must be >= 0, got {self.final_logit_softcapping!r}")
        return out


def scale_and_cap(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The reference's `compute_logits` after the lm_head: times `multiplier`, then softcap * tanh(x /
    softcap) when softcap > 0. A multiplier of 1 and no cap leave the logits as they are."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def block_causal_convolve(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int, block_size: int
) -> torch.Tensor:
    """out[t] = sum over offsets o of (base[o] + dynamic[t, o, g]) * x[t - o], channel group g by group.

    x [b, Q, D]; dynamic [b, Q, K, D / group_size]; base [K, D]. x[t - o] counts as zero where t - o
    lies before the start of t's block (blocks of `block_size` positions along Q, the last one possibly
    shorter): the convolution never reads a later position or another block.
    """
    b, q, d = x.shape
    groups = d // group_size
    k = min(base.shape[0], q)
    base = base.to(x.dtype).view(-1, groups, group_size)
    slot = torch.arange(q, device=x.device) % block_size  # each position's place in its block
    # x[t - o] as a view of one padded copy: the backward keeps that copy, not one shifted copy an offset
    padded = F.pad(x, (0, 0, k - 1, 0)).view(b, q + k - 1, groups, group_size)
    out = None
    for o in range(k):
        term = (base[o] + dynamic[:, :, o, :, None]) * padded[:, k - 1 - o : k - 1 - o + q]
        if o > 0:
            term = term * (slot >= o).to(x.dtype)[:, None, None]
        out = term if out is None else out + term
    return out.view(b, q, d)


class GroupedDynamicCausalConv(nn.Module):
    """Two causal convolutions around one sublayer: `prepare` before it, `finish` after it. Each has a
    learned base kernel [K, D] plus a per-position kernel [K, groups] projected from the sublayer's input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity_()

    def reset_to_identity_(self) -> None:
        """prepare and finish return their input: the offset-0 tap 1, the others and the projection 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's input convolved, the per-position kernel `finish` takes)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[:, :, 0], 0), dynamic[:, :, 1]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, 1)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, side: int) -> torch.Tensor:
        return block_causal_convolve(x, dynamic, self.base_kernel[side], self.group_size, self.block_size)


def gumbel_max(scaled: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A sample of softmax(scaled) along the last axis by the Gumbel-max trick: argmax(scaled + G) with
    G = -log(-log U), U uniform on [0, 1) (`uniform`, same shape). Exact in law, and a pure function of
    its inputs, so that a sampler with noise drawn up front replays in a CUDA graph."""
    return (scaled - torch.log(-torch.log(uniform))).argmax(dim=-1)


class SelectorPath(NamedTuple):
    """The selector's drafts for one block: tokens [b, P], the candidates [b, P, k] they were chosen from
    and, at T > 0, each position's proposal probabilities over its candidates [b, P, k] (None at T = 0)."""

    tokens: torch.Tensor
    candidates: torch.Tensor
    probs: torch.Tensor | None


class CandidateSelector(nn.Module):
    """Top-k of each draft position's logits (the unary scores) plus a low-rank pairwise score of each
    candidate given the token chosen before it; the block is walked left to right from the anchor."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # plain parameters, not nn.Embedding: z-lab checkpoints name them without a `.weight`
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.normal_(self.successor_codebook, std=0.02)
        self.reset_to_unary_()

    def reset_to_unary_(self) -> None:
        """Every pairwise score 0, so that the path is the argmax of the logits at T = 0. Only the hidden
        projection is zeroed: with the codebooks random, the scores' gradient with respect to it is not
        zero and the selector learns from its first step (zero codebooks too would leave every gradient of
        the product zero)."""
        with torch.no_grad():
            self.hidden_projection.weight.zero_()

    def pairwise(self, gate: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """<predecessor_codebook[previous] * gate, successor_codebook[candidate]> [..., k], for
        gate [..., rank] (the projected hidden state), previous [...] and candidates [..., k]."""
        condition = F.embedding(previous, self.predecessor_codebook) * gate
        successors = F.embedding(candidates, self.successor_codebook)
        return (successors @ condition.unsqueeze(-1)).squeeze(-1)

    def select(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float,
        noise: torch.Tensor | None = None,
    ) -> SelectorPath:
        """Drafts for the draft positions: hidden [b, P, D], their logits [b, P, V], the anchor tokens [b].
        At T = 0 each position takes its best-scoring candidate; at T > 0 a sample of
        softmax(scores / T), drawn by `gumbel_max` from `noise` [b, P, k] (uniform on [0, 1)), whose
        probabilities come back for the rejection step. Noise instead of a generator: the walk then has
        no host-side random state, so that it replays inside a CUDA graph."""
        if temperature > 0 and noise is None:
            raise ValueError("sampling the selector's path (T > 0) needs its uniform noise [b, P, k]")
        unary, candidates = logits.topk(self.top_k, dim=-1)
        gate = self.hidden_projection(hidden)
        previous, tokens, probs = anchor_ids, [], []
        for p in range(hidden.shape[1]):
            scores = unary[:, p] + self.pairwise(gate[:, p], previous, candidates[:, p])
            if temperature > 0:
                scaled = scores.float() / temperature
                pick = gumbel_max(scaled, noise[:, p])
                probs.append(torch.softmax(scaled, dim=-1))
            else:
                pick = scores.argmax(dim=-1)
            previous = candidates[:, p].gather(-1, pick[:, None])[:, 0]
            tokens.append(previous)
        return SelectorPath(torch.stack(tokens, 1), candidates, torch.stack(probs, 1) if probs else None)
