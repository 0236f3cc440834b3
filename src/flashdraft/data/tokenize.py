"""A conversation -> (input_ids, loss_mask) with the target's own chat template, whatever the template;
a plain-text record -> the same without one (`tokenize_plain`).

Templates differ in role headers, end-of-turn tokens, whitespace trimming and how they show reasoning,
and few mark assistant text with `{% generation %}`; so the assistant spans are found in the rendered
text itself. Assistant turn i starts where the template's generation prompt for messages[:i] ends: what
the model is given at inference, e.g. `<|im_start|>assistant\\n` (plus an empty think block for Qwen3 with
thinking off). It ends after the rendered content and the special token that closes the turn, e.g.
`<|im_end|>`: what the model must emit to stop. The rendered content is located by rendering the
conversation again with that one message replaced and diffing, which survives templates that trim it or
drop earlier turns' reasoning. The rendering is tokenized once with offsets; a token is a loss token when
its characters lie inside an assistant span.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from flashdraft.data.formats import ConversationError

_PROBE = "\x00"  # stands in for one message's content; never part of real text

Render = Callable[[list[dict], bool], str]


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_length: int | None = None,
    enable_thinking: bool | None = None,
    chat_template: str | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask that is 1 exactly on assistant-written tokens.

    Raises ConversationError (a ValueError) when the template fails on the conversation, an assistant turn
    cannot be located, or no loss token is left (after truncation to `max_length`), and ValueError when
    there is no chat template at all.
    """
    check_tokenizer(tokenizer)
    if not has_chat_template(tokenizer, chat_template):
        raise ValueError(no_template_message(tokenizer))
    render = _renderer(tokenizer, enable_thinking, chat_template)
    text = render(messages, False)
    spans = assistant_spans(render, messages, text, _closer_pattern(_special_tokens(tokenizer)))
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False, return_tensors="np")
    ids, mask = enc["input_ids"][0].tolist(), _span_mask(enc["offset_mapping"][0], spans)
    if not any(mask):
        raise ConversationError("no_loss_tokens", "no assistant token in the rendered conversation")
    return truncate(ids, mask, max_length) if max_length is not None else (ids, mask)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A plain-text prompt's token ids as a target without a chat template is given it: the tokenizer's
    own special tokens added (Gemma's and Llama's <bos>)."""
    return tokenizer(prompt, add_special_tokens=True).input_ids


def tokenize_plain(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Token ids of a plain-text record and a mask that is 1 exactly on the completion's tokens.

    The prompt and the completion are tokenized apart, as serving sees them: the prompt alone
    (`prompt_ids`), then the tokens the target wrote after it. Tokenizing them joined would let a token
    straddle the boundary (a prompt's final newline merged with the completion's indent) and train on a
    split the target never sees. A {"text"} record is a completion with an empty prompt.
    """
    head = prompt_ids(tokenizer, prompt)
    tail = tokenizer(completion, add_special_tokens=False).input_ids
    if not tail:
        raise ConversationError("no_loss_tokens", "the completion has no token")
    return head + tail, [0] * len(head) + [1] * len(tail)


def has_chat_template(tokenizer, chat_template: str | None = None) -> bool:
    return bool(chat_template or getattr(tokenizer, "chat_template", None))


def truncate(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """The first `max_length` tokens; an error if none of them is a loss token."""
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise ConversationError("no_loss_tokens", f"no assistant token within the first {max_length} tokens")
    return ids, mask


def check_tokenizer(tokenizer) -> None:
    """Fail early, once, on what would fail every conversation: no offsets."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("loss masks need a fast (Rust) tokenizer, which reports character offsets")


def no_template_message(tokenizer) -> str:
    return (
        f"the target's tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: chat "
        'records need one (--chat-template FILE); a base model trains on {"prompt", "completion"} or '
        '{"text"} records'
    )


def assistant_spans(
    render: Render, messages: list[dict], text: str, closer: re.Pattern
) -> list[tuple[int, int]]:
    """[start, end) character spans of the assistant-written text of each assistant turn in `text`."""
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        content_start, content_end = _content_bounds(render, messages, i, text)
        start = _turn_start(render, messages, i, text, content_start)
        end = _after_closer(text, content_end, closer)
        if end <= start or (spans and start < spans[-1][1]):
            raise ConversationError("template_error", f"cannot locate assistant turn {i} in the rendering")
        spans.append((start, end))
    return spans


def _renderer(tokenizer, enable_thinking: bool | None, chat_template: str | None) -> Render:
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **extra,
            )
        except Exception as e:  # a template is code from the model's authors: any failure is this record's
            raise ConversationError("template_error", f"chat template failed: {e}") from e

    return render


def _turn_start(render: Render, messages: list[dict], i: int, text: str, content_start: int) -> int:
    prompt = render(messages[:i], True)
    if text.startswith(prompt):
        return len(prompt)
    # The template renders this turn differently once later turns follow it (Qwen3 drops the empty think
    # block of earlier turns): the turn starts where the rendering stops matching the generation prompt.
    return min(_common_prefix(text, prompt), content_start)


def _content_bounds(render: Render, messages: list[dict], i: int, text: str) -> tuple[int, int]:
    """Where message i's content, as rendered, lies in `text`: the part that changes with it."""
    probe = [*messages[:i], {**messages[i], "content": _PROBE}, *messages[i + 1 :]]
    other = render(probe, False)
    if other == text:
        raise ConversationError("template_error", f"the chat template does not render assistant turn {i}")
    start = _common_prefix(text, other)
    end = len(text) - _common_suffix(text, other, min(len(text), len(other)) - start)
    return start, end


def _after_closer(text: str, pos: int, closer: re.Pattern) -> int:
    match = closer.match(text, pos)
    return match.end() if match else pos


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search: slice comparisons run in C, a char loop would not
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _special_tokens(tokenizer) -> tuple[str, ...]:
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    return tuple(sorted({t.content for t in added if t.special} | set(tokenizer.all_special_tokens)))


@lru_cache(maxsize=8)
def _closer_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    """Optional whitespace, then a special token: how templates close a turn (`<|im_end|>`, `<|eot_id|>`)."""
    if not tokens:
        return re.compile(r"(?!)")
    alternatives = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
    return re.compile(rf"\s*(?:{alternatives})")


def _span_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> list[int]:
    """1 for tokens whose [start, end) offsets lie inside one of the sorted, disjoint spans."""
    bounds = np.array(spans, dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    k = np.searchsorted(bounds[:, 1], starts, side="right")  # first span ending after the token starts
    k_safe = np.minimum(k, len(bounds) - 1)
    inside = (k < len(bounds)) & (bounds[k_safe, 0] <= starts) & (ends <= bounds[k_safe, 1])
    return inside.astype(np.int64).tolist()
