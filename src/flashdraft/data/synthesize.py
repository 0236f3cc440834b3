"""`flashdraft data synthesize`: user turns written by the target itself, for a user with no dataset.

The Magpie method (Xu et al. 2024, arXiv 2406.08464): given only its chat template's text up to the
content of a user turn, an aligned chat model writes a plausible request and ends the turn with the
template's end-of-turn token. A system message before the user header (`system`) steers what is asked,
as Magpie's domain-specific sets do (e.g. "You are a Python programming assistant." for coding requests);
it only steers: the records hold the user turn alone, answered later under the template's default.
Batches of that prefix are sampled, each batch from its own seed, and every sample is kept or dropped
with a reason:
- `no_end`: the turn did not end within `max_tokens`;
- `template_tokens`: a special token of the template came before the end (a role header, a new turn);
- `empty`: nothing but whitespace;
- `duplicate`: the same text (whitespace and case aside) was kept before.
Kept turns are appended to OUT as `{"id", "messages": [{"role": "user", "content"}]}` records, which `data
regenerate` answers and `data prepare` reads as they are; dropped ones go to OUT.rejected.jsonl with their
reason and text. Each line names its batch and slot, and OUT.settings.json the settings that fix every
batch's samples: a run killed at any point resumes (same command) by sampling the first unfinished batch
again from its seed and writing only the slots it lacks; a line cut short by the kill is dropped.

A target without a chat template (a base model) has no user turn to write: it writes texts from its
beginning-of-sequence token alone, and each, cut at `max_tokens` or where it ends, is kept as a
`{"id", "prompt"}` record that `data regenerate` continues (the same drops, `no_end` aside).

Written here because no maintained library samples Magpie-style from an arbitrary chat template;
transformers' `generate` does the sampling.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashdraft.data.settings import check_settings
from flashdraft.data.tokenize import has_chat_template
from flashdraft.model.target import clear_generation_defaults

SENTINEL = "\x00FLASHDRAFT-USER-TURN\x00"
REASONS = ("no_end", "template_tokens", "empty", "duplicate")


@dataclass(frozen=True)
class SynthesisOptions:
    count: int  # user turns to keep
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    batch_size: int = 64
    seed: int = 0
    max_samples: int | None = None  # give up after this many samples; default 8 x count
    system: str | None = None  # a system message that steers the requests; not kept in the records

    def settings(self) -> dict:
        """What decides every batch's samples: a resumed run must match them."""
        return {k: v for k, v in asdict(self).items() if k not in ("count", "max_samples")}


@dataclass
class SynthesisSummary:
    kept: int
    rejected: dict[str, int]
    samples: int  # drawn by this run
    already: int  # kept turns found in OUT at start
    rejected_path: Path


def rejected_path_for(out_path: str | Path) -> Path:
    return Path(str(out_path) + ".rejected.jsonl")


def user_turn_frame(tokenizer, system: str | None = None) -> tuple[str, list[int]]:
    """(the template's text before a user turn's content, after `system` as a system message when given,
    the token ids that end a user turn): the first token after the content, which must be a special token
    (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>), and the end-of-sequence ids."""
    messages = [{"role": "user", "content": SENTINEL}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    prefix, found, suffix = text.partition(SENTINEL)
    if not found:
        raise ValueError("the chat template does not render a user turn's content")
    first = tokenizer(suffix, add_special_tokens=False).input_ids[:1]
    if not first or first[0] not in special_ids(tokenizer):
        raise ValueError(
            f"the chat template ends a user turn with {suffix[:20]!r}, not a special token: Magpie sampling "
            "needs an end-of-turn token to stop at"
        )
    eos = tokenizer.eos_token_id
    return prefix, sorted({first[0], *([eos] if eos is not None else [])})


def text_frame(tokenizer) -> tuple[list[int], list[int]]:
    """(the ids a text starts from, the ids that end it) for a target without a chat template: the
    tokenizer's own special tokens before a text (its <bos>), and the end-of-sequence id."""
    start = tokenizer("", add_special_tokens=True).input_ids
    if not start:
        raise ValueError(
            "the tokenizer adds no beginning-of-sequence token and has no chat template: there is nothing "
            "to sample a text from; give prompts (`data prompts --input FILES`)"
        )
    eos = tokenizer.eos_token_id
    return start, [eos] if eos is not None else []


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: its named ones and every added token marked special (a tokenizer
    converted from GGUF by transformers 5.17 names neither <|im_start|> nor <|im_end|>)."""
    added = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return set(tokenizer.all_special_ids) | added


def classify(
    new_ids: list[int], end_ids: list[int], special_ids: set[int], tokenizer, need_end: bool = True
) -> tuple[str, str | None]:
    """(the turn's text, None) for a sample to keep, or (its text, the reason it is dropped); a text
    sampled for a prompt (`need_end` False) may stop at `max_tokens`."""
    ends = [i for i, t in enumerate(new_ids) if t in end_ids]
    body = new_ids[: ends[0]] if ends else new_ids
    text = tokenizer.decode(body, skip_special_tokens=False).strip()
    if not ends and need_end:
        return text, "no_end"
    if any(t in special_ids for t in body):
        return text, "template_tokens"
    return text, None if text else "empty"


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


def _read_lines(path: Path) -> list[dict]:
    """Records of a JSONL file this module wrote; a last line cut short by a kill is removed."""
    if not path.exists():
        return []
    records, good = [], 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            try:
                records.append(json.loads(line))
            except ValueError as e:
                raise ValueError(
                    f"{path}:{n}: not a line written by `data synthesize`; fix or remove it"
                ) from e
            good += len(line)
    if good < path.stat().st_size:
        os.truncate(path, good)
    return records


def _append(file, record: dict) -> None:
    file.write(json.dumps(record, ensure_ascii=False) + "\n")
    file.flush()


def synthesize(
    model,
    tokenizer,
    out_path: str | Path,
    options: SynthesisOptions,
    advance: Callable[[], None] = lambda: None,
) -> SynthesisSummary:
    """Sample user turns until `options.count` are kept in `out_path` (or `max_samples` are drawn);
    `advance()` is called once per kept turn. Resumes what an earlier run of the same settings wrote."""
    out, rejected = Path(out_path), rejected_path_for(out_path)
    kept_records, rejected_records = _read_lines(out), _read_lines(rejected)
    check_settings(out, options.settings(), bool(kept_records or rejected_records))
    done = {(r["batch"], r["slot"]) for r in kept_records + rejected_records}
    seen = {_key(r["prompt"] if "prompt" in r else r["messages"][0]["content"]) for r in kept_records}
    summary = SynthesisSummary(len(kept_records), dict.fromkeys(REASONS, 0), 0, len(kept_records), rejected)
    batch = max((b for b, _ in done), default=0)  # the last batch begun; the next one if it is whole
    if done and all((batch, s) in done for s in range(options.batch_size)):
        batch += 1
    clear_generation_defaults(model)  # the options alone say how turns are sampled
    plain = not has_chat_template(tokenizer)
    if plain and options.system is not None:
        raise ValueError("a system message steers a chat template's user turn; this target has no template")
    if plain:
        prefix_ids, end_ids = text_frame(tokenizer)
    else:
        prefix, end_ids = user_turn_frame(tokenizer, options.system)
        prefix_ids = tokenizer(prefix, add_special_tokens=False).input_ids
    special = special_ids(tokenizer) - set(end_ids)
    limit = options.max_samples or 8 * options.count
    with open(out, "a", encoding="utf-8") as out_file, open(rejected, "a", encoding="utf-8") as rej_file:
        while summary.kept < options.count and summary.samples < limit:
            for slot, new_ids in enumerate(_sample(model, tokenizer, prefix_ids, end_ids, options, batch)):
                if (batch, slot) in done or summary.kept >= options.count:
                    continue
                summary.samples += 1
                text, reason = classify(new_ids, end_ids, special, tokenizer, need_end=not plain)
                if reason is None and _key(text) in seen:
                    reason = "duplicate"
                where = {"batch": batch, "slot": slot}
                if reason is None:
                    seen.add(_key(text))
                    turn = {"prompt": text} if plain else {"messages": [{"role": "user", "content": text}]}
                    _append(out_file, {"id": f"synth-{batch:05d}-{slot:03d}", **turn, **where})
                    summary.kept += 1
                    advance()
                else:
                    _append(rej_file, {"reason": reason, "text": text, **where})
                    summary.rejected[reason] += 1
            batch += 1
    return summary


@torch.no_grad()
def _sample(
    model, tokenizer, prefix_ids: list[int], end_ids: list[int], options: SynthesisOptions, batch: int
):
    """The new tokens of every slot of batch `batch`: a pure function of the settings and the batch."""
    torch.manual_seed(options.seed * 1_000_003 + batch)
    ids = torch.tensor([prefix_ids] * options.batch_size, device=model.device)
    sampling = (
        {"do_sample": True, "temperature": options.temperature, "top_p": options.top_p, "top_k": 0}
        if options.temperature > 0
        else {"do_sample": False}
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=options.max_tokens,
        eos_token_id=end_ids,
        pad_token_id=pad,
        **sampling,
    )
    return out[:, len(prefix_ids) :].tolist()
