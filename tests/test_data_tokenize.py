"""Loss masks: 1 exactly on assistant-written tokens, end-of-turn token included, headers excluded."""

import copy

import numpy as np
import pytest

from flashdraft.data.formats import ConversationError
from flashdraft.data.tokenize import _span_mask, tokenize_conversation

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello, world."},
    {"role": "user", "content": "More?"},
    {"role": "assistant", "content": "Yes: more."},
]

# The tiny tokenizer's ChatML rendering of CONVERSATION, written out by hand.
CHATML_TEXT = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello, world.<|im_end|>\n"
    "<|im_start|>user\nMore?<|im_end|>\n"
    "<|im_start|>assistant\nYes: more.<|im_end|>\n"
)

# Qwen3's chat template, text-only: earlier turns lose their reasoning, the last turn after the last user
# query always shows a think block, and the generation prompt holds an empty one with thinking off.
QWEN3_TEMPLATE = """
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}{%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""  # noqa: E501


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """The decoded text of each maximal run of loss tokens."""
    runs, current = [], []
    for token, bit in zip([*ids, None], [*mask, 0], strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def test_chatml_mask_covers_exactly_each_answer_and_its_end_of_turn_token(tiny_tokenizer):
    ids, mask = tokenize_conversation(tiny_tokenizer, CONVERSATION)
    assert ids == tiny_tokenizer(CHATML_TEXT, add_special_tokens=False)["input_ids"]
    assert masked_runs(tiny_tokenizer, ids, mask) == ["Hello, world.<|im_end|>", "Yes: more.<|im_end|>"]
    assert set(mask) == {0, 1} and len(mask) == len(ids)


def test_qwen3_thinking_off_excludes_the_empty_think_block_the_prompt_supplies(tiny_tokenizer):
    ids, mask = tokenize_conversation(
        tiny_tokenizer, CONVERSATION, enable_thinking=False, chat_template=QWEN3_TEMPLATE
    )
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nYes: more." in tiny_tokenizer.decode(ids)
    assert masked_runs(tiny_tokenizer, ids, mask) == ["Hello, world.<|im_end|>", "Yes: more.<|im_end|>"]


def test_qwen3_thinking_on_trains_the_think_block_the_model_writes(tiny_tokenizer):
    thought = [*CONVERSATION[:-1], {"role": "assistant", "content": "<think>\nLet me see.\n</think>\n\nYes."}]
    ids, mask = tokenize_conversation(
        tiny_tokenizer, thought, enable_thinking=True, chat_template=QWEN3_TEMPLATE
    )
    assert masked_runs(tiny_tokenizer, ids, mask) == [
        "Hello, world.<|im_end|>",
        "<think>\nLet me see.\n</think>\n\nYes.<|im_end|>",
    ]


def test_a_template_that_trims_content_still_masks_the_rendered_answer(tiny_tokenizer):
    trimming = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    padded = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  An answer. \n"}]
    ids, mask = tokenize_conversation(tiny_tokenizer, padded, chat_template=trimming)
    assert masked_runs(tiny_tokenizer, ids, mask) == ["An answer.<|im_end|>"]


def test_truncation_keeps_the_first_tokens_and_fails_when_no_answer_is_left(tiny_tokenizer):
    ids, mask = tokenize_conversation(tiny_tokenizer, CONVERSATION)
    first_answer = mask.index(1)
    short_ids, short_mask = tokenize_conversation(tiny_tokenizer, CONVERSATION, max_length=first_answer + 2)
    assert (short_ids, short_mask) == (ids[: first_answer + 2], mask[: first_answer + 2])
    with pytest.raises(ConversationError, match="no assistant token") as e:
        tokenize_conversation(tiny_tokenizer, CONVERSATION, max_length=first_answer)
    assert e.value.reason == "no_loss_tokens"


def test_a_tokenizer_without_chat_template_needs_one_given(tiny_tokenizer):
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_conversation(bare, CONVERSATION)
    given = tokenize_conversation(bare, CONVERSATION, chat_template=tiny_tokenizer.chat_template)
    assert given == tokenize_conversation(tiny_tokenizer, CONVERSATION)


def test_a_template_that_refuses_the_conversation_is_a_template_error(tiny_tokenizer):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}"
    with pytest.raises(ConversationError, match="must start with user") as e:
        tokenize_conversation(
            tiny_tokenizer, CONVERSATION, chat_template=strict + tiny_tokenizer.chat_template
        )
    assert e.value.reason == "template_error"


def test_qwen3_earlier_answer_that_starts_like_the_think_block_is_masked_whole(tiny_tokenizer):
    # Earlier turns render without the think block, so the generation prompt is not a prefix of the
    # rendering there; an answer starting with "<" must still be a loss token from its first character.
    tagged = [CONVERSATION[1], {"role": "assistant", "content": "<b>bold</b>"}, *CONVERSATION[3:]]
    ids, mask = tokenize_conversation(
        tiny_tokenizer, tagged, enable_thinking=False, chat_template=QWEN3_TEMPLATE
    )
    assert masked_runs(tiny_tokenizer, ids, mask) == ["<b>bold</b><|im_end|>", "Yes: more.<|im_end|>"]


def test_a_token_straddling_a_span_edge_is_not_a_loss_token():
    offsets = np.array([[0, 2], [2, 5], [5, 9], [9, 12]])
    assert _span_mask(offsets, [(3, 9)]) == [0, 0, 1, 0]
    assert _span_mask(offsets, [(0, 4), (5, 12)]) == [1, 0, 1, 1]
