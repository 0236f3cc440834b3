"""Speculative decoding for evaluation: the drafter's real acceptance length (tau) against the target.

One verification loop, `generate`, serves three methods so that all are measured by the same code:
DFlash drafts (`DFlashProposer`), prompt-lookup drafts (`flashdraft.eval.ngram.NgramProposer`) and
no drafts at all (plain autoregressive decoding, the speed baseline). It follows the decoding of
docs/dflash.md and the reference `dflash` package step for step, so its tau is the reference's tau:

- prefill: the target runs the prompt and picks the first new token; the tapped features of every
  prompt token become the drafter's first context rows;
- each cycle: block = [last verified token, MASK x (B-1)] at positions start..start+B-1 (B shrinks
  near the token budget); drafts = argmax of the target's lm_head on slots 1..B-1; the target verifies
  the block in one forward; the longest prefix where draft k equals the target's token at k-1 is
  accepted, then the target's next token is appended (the bonus); the target cache is cropped and the
  features of the kept tokens become the next context rows.

At T = 0 the target's token is its argmax; at T > 0 it is a sample from softmax(logits / T): argmax
drafts are deterministic (a one-hot proposal), so accepting a draft exactly when it equals an
independent sample, and otherwise keeping that sample, draws every token from the target's own
distribution (lossless). Sampled drafts carry their proposal distribution q (`Proposal`) and are
verified by standard speculative sampling (`speculative_sample`), lossless for any q.

Acceptance length of a cycle = tokens it commits (accepted drafts + the bonus, cut at a stop token, a
stop string or the budget), in [1, B]; tau = its mean per sample, then the mean over samples (as
`dflash` computes it).
transformers' `generate` has no hook for a drafter fed by target hidden states, hence this loop.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from flashdraft.data.formats import (
    TEXT,
    Conversation,
    RawRecord,
    iter_raw_records,
    parse_object,
    parse_record,
)
from flashdraft.data.tokenize import has_chat_template, prompt_ids
from flashdraft.eval.ngram import NgramProposer
from flashdraft.eval.static import (
    Graphs,
    StaticDFlashProposer,
    StaticTarget,
    block_drafts,
    draft_hidden,
    layer_visibility,
    noise_shape,
)
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.target import Target, stop_token_ids


@dataclass
class Proposal:
    """Draft tokens [1, n] and, for sampled drafts, the distribution q each was drawn from.

    q None: the drafts are deterministic (a one-hot proposal, verified by equality with the target's
    token). q [1, n, V] with support None: q over the whole vocabulary. q [1, n, k] with support
    [1, n, k]: q over the candidate ids `support` (DFlash2's candidate selector), zero elsewhere.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    support: torch.Tensor | None = None

    def __post_init__(self):
        if self.support is not None and self.q is None:
            raise ValueError("a Proposal's candidate ids (support) need their probabilities q")

    def dense_q(self, vocab_size: int) -> torch.Tensor:
        """q over the whole vocabulary [1, n, V], float32 (candidate probabilities put at their ids)."""
        q = self.q.float()
        if self.support is None:
            return q
        return q.new_zeros(*q.shape[:-1], vocab_size).scatter_add_(-1, self.support, q)


class Proposer(Protocol):
    """A source of draft tokens for `generate`."""

    def observe(self, token_ids: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """Verified tokens [1, n] at positions start..start+n-1 and their tapped features [1, n, N*D]."""

    def propose(self, last_token: torch.Tensor, start: int, num_drafts: int) -> Proposal | torch.Tensor:
        """At most `num_drafts` drafts to follow `last_token` (a [1] tensor at position `start`): a
        Proposal, or bare tokens [1, k] for a deterministic proposer (the same as Proposal(tokens))."""


@dataclass
class Generation:
    """One prompt's decoding: new tokens (the first from the prefill) and per-cycle statistics."""

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify cycle
    verify_sizes: list[int] = field(default_factory=list)  # tokens the target verified per cycle
    ttft_s: float = 0.0  # prefill, up to the first new token
    decode_s: float = 0.0  # every cycle after it

    @property
    def tau(self) -> float:
        """Mean acceptance length over this sample's cycles; nan when no cycle ran."""
        if not self.accept_lengths:
            return math.nan
        return sum(self.accept_lengths) / len(self.accept_lengths)


def sampling_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distribution sampled at T > 0: softmax(logits / T) over the last axis, float32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_tokens(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of logits [n, V]: the argmax at T = 0, else a sample of softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, temperature), 1, generator=generator).squeeze(-1)


def speculative_sample(p: torch.Tensor, proposal: Proposal, generator: torch.Generator | None) -> list[int]:
    """Standard speculative sampling of one block: the accepted drafts, then one token drawn by the rule.

    p [n + 1, V]: the target's sampling distribution at the block's slots (row i scores draft i, row n
    follows the last draft); proposal: n drafts with their q. In order, draft i is accepted with
    probability min(1, p_i(x) / q_i(x)); at the first rejection the next token is drawn from the
    normalised residual max(0, p_i - q_i), after n acceptances from p_n. Every emitted token then has
    the target's law, whatever q is (Leviathan et al. 2023; Chen et al. 2023).
    """
    drafts = proposal.tokens[0]
    n = drafts.shape[0]
    q = proposal.dense_q(p.shape[-1])[0]
    rows = torch.arange(n, device=p.device)
    u = torch.rand(n, generator=generator, device=p.device)
    # u < p / q without the division: never accepts where p = 0, always where p >= q
    accepted = int((u * q[rows, drafts] < p[rows, drafts]).cumprod(0).sum())
    if accepted == n:
        law = p[n]
    else:
        residual = (p[accepted] - q[accepted]).clamp_min(0)
        law = residual if residual.sum() > 0 else p[accepted]  # p = q: a rejection had probability 0
    return drafts[:accepted].tolist() + torch.multinomial(law, 1, generator=generator).tolist()


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """A target KV cache that can be cropped (sliding-window layers keep the states crop needs)."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


class DynamicTarget:
    """The target's forwards on a DynamicCache, cropped to the kept tokens after each cycle (the
    interface of flashdraft.eval.static.StaticTarget).

    A cache with a layer that cannot be cropped (the recurrent state of a linear-attention layer:
    Qwen3-Next, Qwen3.5) is copied before each verify instead; when drafts are rejected the copy comes
    back and the target runs the kept tokens again, so the state is the one plain decoding would have.
    That costs a copy per cycle and a second forward per rejecting cycle, as any engine without
    per-token state snapshots pays: the acceptance is exact, the timing of such a target is that.
    """

    def __init__(self, target: Target):
        self.target = target
        self.cache: DynamicCache | None = None
        self.before: DynamicCache | None = None  # the cache before the last verify, where not croppable
        self.block: torch.Tensor | None = None

    def prefill(self, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache = new_cache(self.target.model)
        out = self.target.decode(prompt_ids, self.cache, logits_to_keep=1)
        # a recording sliding-window layer keeps the whole prompt until a crop; transformers 5.17 then
        # hands the next forward more keys than its mask covers (5.24 slices them itself)
        self.cache.crop(0)
        return out

    def forward(self, block: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        layers = getattr(self.cache, "layers", [None])
        croppable = all(getattr(layer, "is_croppable", False) for layer in layers)
        self.before = None if croppable else copy.deepcopy(self.cache)
        self.block = block
        return self.target.decode(block, self.cache)

    def keep(self, kept: int, width: int) -> None:
        if self.before is not None and kept < width:
            self.cache = self.before
            self.target.decode(self.block[:, :kept], self.cache)
        # crop(0) trims the states a recording cache kept for a crop (conv states, sliding windows)
        self.cache.crop(kept - width if self.before is None else 0)
        self.before = self.block = None


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class DFlashProposer:
    """Drafts a block in one drafter forward; its KV cache holds context rows only (block K/V are dropped).

    temperature 0: the drafts are the argmax of the drafter's logits (one-hot proposals, the default), or
    for DFlash2 the candidate selector's best path from the last token.
    temperature > 0: each draft is sampled independently from softmax(logits / T) and carries that q for
    speculative sampling, as the reference `dflash` package drafts at T > 0; for DFlash2 the selector
    samples one path and each position carries its q over the candidates. The samples come from uniform
    noise drawn with `generator` (drafts_from_hidden), as the fixed-shape path draws them.
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        target: Target,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        target.require_taps(drafter.target_layer_ids)
        self.drafter = drafter
        self.target = target
        self.temperature = temperature
        self.generator = generator
        self.dtype = drafter.fc.weight.dtype
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def observe(self, token_ids: torch.Tensor, features: torch.Tensor, start: int) -> None:
        positions = torch.arange(start, start + features.shape[1], device=features.device)[None]
        rows = self.drafter.context_kv(self.drafter.fuse(features.to(self.dtype)), positions)
        if self.kv:
            rows = [
                (torch.cat([k0, k], 2), torch.cat([v0, v], 2))
                for (k0, v0), (k, v) in zip(self.kv, rows, strict=True)
            ]
        self.kv = rows

    def hidden(self, last_token: torch.Tensor, start: int, num_drafts: int) -> torch.Tensor:
        """The drafter's hidden states [1, num_drafts, D] for the block after `last_token` at `start`."""
        mask = last_token.new_full((1, num_drafts), self.drafter.mask_token_id)
        block = torch.cat([last_token.view(1, 1), mask], dim=1)
        positions = torch.arange(start, start + num_drafts + 1, device=block.device)[None]
        cached = self.kv[0][0].shape[2] if self.kv else 0  # context rows at positions 0..cached-1
        keys = torch.cat([torch.arange(cached, device=block.device), positions[0]])
        vis = layer_visibility(self.drafter, None, keys, positions[0])
        return draft_hidden(self.drafter, self.target, block, positions, self.kv, vis)

    def logits(self, last_token: torch.Tensor, start: int, num_drafts: int) -> torch.Tensor:
        """The drafter's logits [num_drafts, V] for the block after `last_token` at position `start`."""
        hidden = self.hidden(last_token, start, num_drafts)
        return self.drafter.logits(hidden, self.target.lm_head)[0]

    def propose(self, last_token: torch.Tensor, start: int, num_drafts: int) -> Proposal:
        hidden = self.hidden(last_token, start, num_drafts)
        return drafts_from_hidden(
            self.drafter, hidden, last_token, self.target.lm_head, self.temperature, self.generator
        )


class StaticSampledProposer:
    """Sampled drafts on the fixed-shape drafter (CUDA graphs): the prompt's generator draws the noise
    as DFlashProposer draws it, and the graph samples from it (StaticDFlashProposer.sample)."""

    def __init__(self, static: StaticDFlashProposer, temperature: float, generator: torch.Generator | None):
        self.static, self.temperature, self.generator = static, temperature, generator

    def observe(self, token_ids: torch.Tensor, features: torch.Tensor, start: int) -> None:
        self.static.observe(token_ids, features, start)

    def propose(self, last_token: torch.Tensor, start: int, num_drafts: int) -> Proposal:
        return Proposal(*self.static.sample(last_token, start, num_drafts, self.temperature, self.generator))


def drafts_from_hidden(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,
    last_token: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float,
    generator: torch.Generator | None,
) -> Proposal:
    """One block's drafts from the drafter's hidden states [1, n, D] (block_drafts): at T > 0 sampled
    from uniform noise that `generator` draws (one call, the shape of noise_shape)."""
    noise = None
    if temperature > 0:
        shape = noise_shape(drafter, lm_head, hidden.shape[1])
        noise = torch.empty(shape, device=hidden.device).uniform_(generator=generator)
    return Proposal(*block_drafts(drafter, lm_head, hidden, last_token.view(1), temperature, noise))


def _verify(
    logits: torch.Tensor, proposal: Proposal, temperature: float, generator: torch.Generator | None
) -> list[int]:
    """From the target's logits over the block [1, n + 1, V]: the accepted drafts + the next token.

    Sampled drafts (q given) at T > 0 go through speculative sampling. Otherwise draft i is accepted
    when it equals the target's token at slot i (its argmax at T = 0, a sample at T > 0), which is
    speculative sampling with a one-hot q, and at T = 0 also what it gives for any q (p is one-hot).
    """
    if temperature > 0 and proposal.q is not None:
        return speculative_sample(sampling_probs(logits[0], temperature), proposal, generator)
    picked = sample_tokens(logits[0], temperature, generator)
    drafts = proposal.tokens[0]
    accepted = int((drafts == picked[:-1]).cumprod(0).sum())
    return torch.cat([drafts[:accepted], picked[accepted : accepted + 1]]).tolist()


class StopText:
    """Stop strings, as a completions API takes them: decoding ends at the first token after which the
    new text (the prompt's not included) holds one of `strings`, that token kept. HumanEval's
    completion protocol stops a function's body at the next top-level statement this way."""

    def __init__(self, tokenizer, strings: Sequence[str]):
        if not strings or any(not isinstance(t, str) or not t for t in strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(strings)!r}")
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        # a token decodes to a byte or more, so a match the new tokens complete starts within this many
        # tokens before them (two more: a decoder may strip the first token's leading space)
        self.context = max(len(t.encode()) for t in self.strings) + 2

    def _found(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return any(t in text for t in self.strings)

    def keep(self, before: list[int], new: list[int]) -> int | None:
        """How many of `new` to commit when, after `before` (the new tokens so far, none of which
        completed a stop string), they complete one; None when they do not. Only the tail of `before`
        a match can start in is decoded: every cycle of a timed decoding runs this."""
        before = before[-self.context :]
        if not self._found(before + new):
            return None
        return next(k for k in range(1, len(new) + 1) if self._found(before + new[:k]))


def _cut_at_stop(tokens: list[int], stops: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1], True
    return tokens, False


@torch.inference_mode()
def generate(
    target: Target,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    proposer: Proposer | None = None,
    block_size: int = 16,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    static: StaticTarget | None = None,
    stop_text: StopText | None = None,
) -> Generation:
    """Decode up to `max_new_tokens` after prompt_ids [1, n] (stop tokens are kept in the output, and so
    is the token that completes a stop string of `stop_text`).

    With a proposer, each cycle verifies its drafts (at most block_size - 1); without one, every cycle
    verifies a single token: plain autoregressive decoding by the same code. With `static`, the
    target runs on its fixed-shape cache (CUDA graphs on a GPU, flashdraft.eval.static) instead of a
    DynamicCache cropped after each cycle.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = prompt_ids.device
    stops = set(stop_token_ids)
    max_length = prompt_ids.shape[1] + max_new_tokens
    width = block_size if proposer is not None else 1

    forwards = static or DynamicTarget(target)
    t0 = _clock(device)
    logits, features = forwards.prefill(prompt_ids)
    last = sample_tokens(logits[0, -1:], temperature, generator)
    out = Generation(tokens=last.tolist())
    t1 = _clock(device)
    if proposer is not None:  # as in the reference, the drafter first sees the prompt after the first token
        proposer.observe(prompt_ids, features, 0)

    start = prompt_ids.shape[1]
    stopped = out.tokens[0] in stops or (stop_text is not None and stop_text.keep([], out.tokens) == 1)
    while start + 1 < max_length and not stopped:
        size = min(width, max_length - start)
        drafts = proposer.propose(last, start, size - 1) if size > 1 else last.new_empty((1, 0))
        proposal = drafts if isinstance(drafts, Proposal) else Proposal(drafts)
        block = torch.cat([last.view(1, 1), proposal.tokens], dim=1)
        logits, features = forwards.forward(block, start)
        new = _verify(logits, proposal, temperature, generator)
        new, stopped = _cut_at_stop(new[: max_length - start - 1], stops)
        if stop_text is not None and (keep := stop_text.keep(out.tokens, new)) is not None:
            new, stopped = new[:keep], True
        kept = len(new)
        forwards.keep(kept, block.shape[1])
        if proposer is not None:
            proposer.observe(block[:, :kept], features[:, :kept], start)
        out.tokens += new
        out.accept_lengths.append(kept)
        out.verify_sizes.append(block.shape[1])
        start += kept
        last = torch.tensor(new[-1:], device=device)
    out.ttft_s, out.decode_s = t1 - t0, _clock(device) - t1
    return out


# ---- prompts -------------------------------------------------------------------------------------


def chat_messages(record: dict) -> list[dict]:
    """The conversation to continue: a record read as training data is (flashdraft.data.formats: roles,
    content, ShareGPT's form), less a trailing assistant turn; a {"prompt"} record is one user turn. A
    ValueError says what is wrong with it."""
    return _to_continue(parse_object(record, RawRecord("a prompt", 0, b""), require_answers=False))


def _to_continue(conversation: Conversation) -> list[dict]:
    if conversation.kind == TEXT:
        raise ValueError('a {"text"} record is text to train on, not a prompt: use {"prompt": TEXT}')
    messages = list(conversation.messages)
    if messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise ValueError("the conversation holds nothing but an assistant turn")
    return messages


def read_prompts(path: str | Path, limit: int | None = None) -> list[list[dict]]:
    """Conversations (`chat_messages`) from a file of {"messages": [...]} or {"prompt": "..."} records,
    in any form the data commands read (JSONL, a JSON array, Parquet; flashdraft.data.formats); a
    ValueError names the line of the first one that is wrong and says why."""
    conversations = []
    for record in iter_raw_records(str(path)):
        try:
            conversations.append(_to_continue(parse_record(record, require_answers=False)))
        except ValueError as e:
            raise ValueError(f"{record.where}: {e}") from None
        if limit is not None and len(conversations) >= limit:
            break
    if not conversations:
        raise ValueError(f"{path}: no prompts")
    return conversations


def encode_prompt(tokenizer, messages: list[dict], thinking: bool = False) -> list[int]:
    """Token ids of the chat template with the generation prompt (`enable_thinking` set as given). A
    target without a chat template is given a {"prompt"} record's text as it is (flashdraft.data.formats:
    the same rule as its training data), with the tokenizer's own special tokens."""
    if not has_chat_template(tokenizer):
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise ValueError(
                'the target has no chat template: a prompt for it is one {"prompt": TEXT} record, '
                f"not a conversation of {len(messages)} turns"
            )
        return prompt_ids(tokenizer, messages[0]["content"])
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    return tokenizer(text, add_special_tokens=False).input_ids


# ---- entry points --------------------------------------------------------------------------------


def decoding_target(target: Target | PreTrainedModel, drafter: DFlashDrafter) -> Target:
    """A Target that taps the drafter's layers, on a target of the drafter's shape (a bare model is
    wrapped: a Target leaves no hooks behind)."""
    if isinstance(target, Target):
        target.require_taps(drafter.target_layer_ids)
        model = target.model
    else:
        model = target
        target = Target(model, drafter.target_layer_ids)
    check_drafter_fits(model.config, drafter.config.to_dict())
    return target


def check_drafter_fits(target_config, drafter_config: dict) -> None:
    """A ValueError where the target is not of the shape the drafter was trained on: its width,
    vocabulary and depth against the drafter's hidden_size, vocab_size and num_target_layers (the fields
    of its config.json; one it lacks is not checked)."""
    text = target_config.get_text_config()
    width, vocab, depth = (drafter_config.get(k) for k in ("hidden_size", "vocab_size", "num_target_layers"))
    if width is not None and text.hidden_size != width:
        raise ValueError(f"the target's width is {text.hidden_size}, the drafter was trained on {width}")
    if vocab is not None and text.vocab_size != vocab:
        raise ValueError(
            f"the target's vocabulary has {text.vocab_size} tokens, the drafter was trained on one of "
            f"{vocab}: another target's drafter"
        )
    if depth is not None and text.num_hidden_layers != int(depth):
        raise ValueError(
            f"the target has {text.num_hidden_layers} layers, the drafter was trained on a target of {depth}"
        )


def eval_tau(
    target: Target | PreTrainedModel,
    tokenizer,
    drafter: DFlashDrafter,
    prompts: Sequence,
    max_new_tokens: int = 64,
    block_size: int | None = None,
    thinking: bool = False,
    cuda_graphs: bool = False,
    temperature: float = 0.0,
    draft_sampling: str = "auto",
    seed: int = 0,
) -> float:
    """Tau of `drafter` on a few prompts (greedy by default), cheap enough to call every N training steps.

    prompts: token-id lists (tokenizer may then be None), or, with a tokenizer, strings (one user turn)
    or message lists, rendered with its chat template. Stops at the target's end-of-sequence ids.
    cuda_graphs, temperature, draft_sampling and seed: as in run_methods (cuda_graphs wants an eval-mode
    drafter whose weights stay put: not during training).
    """
    draft_sampling = resolve_draft_sampling(draft_sampling, drafter, temperature)
    check_draft_sampling(draft_sampling, temperature)
    spec = decoding_target(target, drafter)
    ids = [_prompt_ids(p, tokenizer, thinking) for p in prompts]
    stops = stop_token_ids(spec.model, tokenizer)
    block = block_size or drafter.block_size
    draft_temperature = temperature if draft_sampling == "sample" else 0.0
    static, static_dflash = (
        static_decoders(spec, drafter, ids, max_new_tokens, block, draft_temperature)
        if cuda_graphs
        else (None, None)
    )
    was_training = drafter.training
    drafter.eval()
    try:
        taus = []
        for i, p in enumerate(ids):
            gen = torch.Generator(device=spec.device).manual_seed(seed + i)
            proposer = _proposer("dflash", drafter, spec, static_dflash, draft_temperature, gen)
            prompt = torch.tensor([p], device=spec.device)
            out = generate(spec, prompt, max_new_tokens, proposer, block, temperature, stops, gen, static)
            taus.append(out.tau)
    finally:
        drafter.train(was_training)
    return mean_tau(taus)


def _prompt_ids(prompt, tokenizer, thinking: bool) -> list[int]:
    if not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("prompts other than token-id lists need a tokenizer")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return encode_prompt(tokenizer, messages, thinking)


def mean_tau(taus: Sequence[float]) -> float:
    """Mean over samples of per-sample tau; samples without a single cycle are left out."""
    valid = [t for t in taus if not math.isnan(t)]
    return sum(valid) / len(valid) if valid else math.nan


METHODS = ("autoregressive", "dflash", "ngram")
# DFlash's drafts: argmax (one-hot), sampled with their q, or auto: argmax for DFlash, and for DFlash2 its
# selector's path sampled at T > 0 (its best path at T = 0)
DRAFT_SAMPLING = ("auto", "argmax", "sample")


def resolve_draft_sampling(draft_sampling: str, drafter: DFlashDrafter, temperature: float) -> str:
    """The drafting rule "auto" stands for with this drafter at this temperature; others as they are."""
    if draft_sampling != "auto":
        return draft_sampling
    return "sample" if drafter.dflash2 is not None and temperature > 0 else "argmax"


def check_draft_sampling(draft_sampling: str, temperature: float) -> None:
    """Refuse a DFlash drafting rule that cannot run as asked, with the reason ("auto" is checked once
    resolve_draft_sampling has made it a rule)."""
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
    if draft_sampling == "sample" and temperature <= 0:
        raise ValueError(
            "sampled drafts are drawn from softmax(drafter logits / T): they need a temperature > 0 "
            "(at T = 0 the drafts are the argmax)"
        )


def _proposer(
    method: str,
    drafter: DFlashDrafter,
    target: Target,
    static_dflash=None,
    draft_temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Proposer | None:
    if method == "dflash" and static_dflash is None:
        return DFlashProposer(drafter, target, draft_temperature, generator)
    if method == "dflash":
        return (
            StaticSampledProposer(static_dflash, draft_temperature, generator)
            if draft_temperature > 0
            else static_dflash
        )
    if method == "ngram":
        return NgramProposer()
    return None


def static_decoders(
    target: Target,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block: int,
    draft_temperature: float = 0.0,
) -> tuple[StaticTarget, StaticDFlashProposer]:
    """The target and the DFlash proposer on fixed-shape caches long enough for every prompt, their
    CUDA graphs (on a GPU) captured for every verify width 1..block (draft_temperature > 0: the drafter's
    graphs sample at it, for StaticSampledProposer)."""
    max_len = max(len(p) for p in prompts) + max_new_tokens + block
    graphs = Graphs(target.device)
    static = StaticTarget(target, max_len, graphs)
    static_dflash = StaticDFlashProposer(drafter, target, max_len, graphs, block)
    static.capture(range(1, block + 1))
    static_dflash.capture(draft_temperature)
    return static, static_dflash


def run_methods(
    target: Target,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    stop_tokens: Sequence[int] = (),
    seed: int = 0,
    progress=None,
    cuda_graphs: bool = False,
    methods: Sequence[str] = METHODS,
    draft_sampling: str = "auto",
    stop_text: StopText | None = None,
) -> dict[str, list[Generation]]:
    """Every prompt through plain decoding, DFlash and prompt lookup (or the `methods` named), interleaved
    so that drifting clocks hit all alike; one short warm-up run per method first (allocator, kernels,
    graph capture) is not measured. cuda_graphs: every method's target forwards and the drafter's on
    fixed-shape caches, replayed as CUDA graphs on a GPU (flashdraft.eval.static). A method's samples do
    not depend on which others run: each prompt's sampling generator is seeded per method.
    draft_sampling: DFlash's drafts, "argmax" (one-hot proposals), "sample" (each drawn from
    softmax(drafter logits / T), DFlash2's selector path sampled, with the prompt's generator and verified
    by speculative sampling; T > 0) or "auto" (resolve_draft_sampling). stop_text: stop strings, for
    every method alike."""
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        raise ValueError(f"methods must be among {METHODS}, got {list(methods)}")
    draft_sampling = resolve_draft_sampling(draft_sampling, drafter, temperature)
    check_draft_sampling(draft_sampling, temperature)
    device = target.device
    draft_temperature = temperature if draft_sampling == "sample" else 0.0
    static, static_dflash = (
        static_decoders(target, drafter, prompts, max_new_tokens, block_size, draft_temperature)
        if cuda_graphs
        else (None, None)
    )

    def proposer(method: str, gen: torch.Generator) -> Proposer | None:
        return _proposer(method, drafter, target, static_dflash, draft_temperature, gen)

    results: dict[str, list[Generation]] = {m: [] for m in methods}
    warm = torch.tensor([prompts[0]], device=device)
    for method in methods:
        gen = torch.Generator(device=device).manual_seed(seed)
        generate(target, warm, min(16, max_new_tokens), proposer(method, gen), block_size, static=static)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=device)
        for method in methods:
            gen = torch.Generator(device=device).manual_seed(seed + i)
            results[method].append(
                generate(
                    target, ids, max_new_tokens, proposer(method, gen), block_size, temperature,
                    stop_tokens, gen, static, stop_text,
                )
            )  # fmt: skip
        if progress is not None:
            progress(i + 1, len(prompts))
    return results
