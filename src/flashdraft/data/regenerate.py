"""`flashdraft data regenerate`: the target rewrites every assistant turn, so the drafter learns the target's
own distribution rather than the dataset author's (docs/dflash.md, training semantics).

Turn by turn: assistant turn k is generated from the conversation with turns < k already rewritten, as
the target sees it when serving; a conversation that ends with a user turn gets an answer appended. A
target without a chat template (a base model) continues {"prompt"} records as plain text instead, its
completion written back as {"id", "prompt", "completion"} (formats.py: one rule for both backends). Two
backends yield (conversation, result) pairs to one driver: `ServerBackend` talks to any OpenAI-compatible
server (SGLang, vLLM) with bounded concurrency, timeouts and retries; `LocalBackend` batches `generate` on
a transformers model, for small targets and tests. The driver appends one JSON line per finished record
and flushes it, so a run killed at any point resumes from the ids already written (a line cut short by the
kill is dropped and redone), and writes every failure with its reason to FILE.failed.jsonl.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from flashdraft.data.formats import (
    PROMPT,
    TEXT,
    Conversation,
    ConversationError,
    SourceError,
    count_records,
    iter_raw_records,
    parse_record,
    with_reasoning,
)
from flashdraft.data.progress import progress_bar
from flashdraft.data.settings import check_settings
from flashdraft.data.tokenize import has_chat_template, no_template_message
from flashdraft.model.grouped_attention import use_grouped_attention
from flashdraft.model.target import (
    cache_argument,
    clear_generation_defaults,
    default_device,
    stop_token_ids,
)

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_MAX_BACKOFF_S = 60.0
# The target's own distribution, softmax(logits / T), which `flashdraft eval` samples and verifies against.
# Left unsaid, a server applies the model's recommended sampling (Qwen3's generation_config: top_k 20, top_p
# 0.95) or its own defaults (llama.cpp: top_k 40, min_p 0.05), and a repetition penalty changes even the
# greedy answers. Sent with every request; top_k -1 is "all tokens" to SGLang, vLLM and llama.cpp alike.
UNTRUNCATED = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass
class Regenerated:
    messages: list[dict[str, str]]
    truncated_turns: int  # turns cut at the token limit instead of ending with end-of-turn


Outcome = tuple[Conversation, Regenerated | ConversationError]


def check_regenerable(conv: Conversation, plain: bool, tokenizer=None) -> None:
    """What a backend can regenerate: conversations and prompt records for a chat target; prompt
    records alone for a target continued as plain text (`plain`). A {"text"} record has no prompt."""
    if conv.kind == TEXT:
        raise ConversationError(
            "no_prompt",
            'a {"text"} record has no prompt to continue: cut texts into prompts (`data prompts`)',
        )
    if plain and conv.kind != PROMPT:
        raise ConversationError("no_chat_template", no_template_message(tokenizer))


def answer_slots(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A copy of the conversation with an empty assistant turn after a final user turn, to be answered."""
    slots = [dict(m) for m in messages]
    if slots and slots[-1]["role"] == "user":
        slots.append({"role": "assistant", "content": ""})
    if not any(m["role"] == "assistant" for m in slots):
        raise ConversationError("missing_assistant", "no assistant turn, and no final user turn to answer")
    return slots


# ------------------------------------------------------------------------------------------ server backend


class ServerBackend:
    """Any OpenAI-compatible `/v1/chat/completions` endpoint, `concurrency` conversations in flight."""

    def __init__(
        self,
        url: str,
        model: str,
        max_tokens: int,
        temperature: float = 0.0,
        enable_thinking: bool | None = None,
        concurrency: int = 64,
        timeout: float = 600.0,
        retries: int = 5,
        backoff: float = 1.0,
        plain: bool = False,
    ):
        self.endpoint = chat_completions_url(url)
        self.plain = plain  # prompt records continued through /v1/completions (a base model)
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.enable_thinking = enable_thinking
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    @property
    def answer_settings(self) -> dict:
        """What the answers depend on: `regenerate_file` keeps one output file to one of these."""
        return {
            "model": self.model,
            **_sampling(self.temperature, self.max_tokens, self.enable_thinking, self.plain),
        }

    def regenerate_each(self, conversations: Iterable[Conversation]) -> Iterator[Outcome]:
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        with httpx.Client(timeout=self.timeout, limits=limits) as client:
            self._check_reachable(client)
            yield from bounded_map(lambda c: self._regenerate(client, c), conversations, self.concurrency)

    def _check_reachable(self, client) -> None:
        """A wrong URL is one clear error before the run, not every record failing after its retries."""
        import httpx

        models = self.endpoint.removesuffix("/chat/completions") + "/models"
        try:
            client.get(models, timeout=min(self.timeout, 30.0))
        except httpx.TransportError as e:
            raise ValueError(f"cannot reach the server at {models}: {type(e).__name__}: {e}") from e

    def _regenerate(self, client, conv: Conversation) -> Regenerated | ConversationError:
        try:
            check_regenerable(conv, self.plain)
            if self.plain:
                body = {"model": self.model, "prompt": conv.prompt, "max_tokens": self.max_tokens,
                        "temperature": self.temperature, **UNTRUNCATED}  # fmt: skip
                text, cut = parse_text_completion(self._post(client, body, "/completions"))
                return Regenerated([conv.messages[0], _answer(text)], int(cut))
            messages, truncated = answer_slots(conv.messages), 0
            for i, message in enumerate(messages):
                if message["role"] == "assistant":
                    message["content"], cut = self._complete(client, messages[:i])
                    truncated += cut
            return Regenerated(messages, truncated)
        except ConversationError as e:
            return e

    def _complete(self, client, messages: list[dict]) -> tuple[str, bool]:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            **UNTRUNCATED,
        }
        if self.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.enable_thinking}
        return parse_completion(self._post(client, body))

    def _post(self, client, body: dict, path: str = "/chat/completions") -> dict:
        """POST with retries on transport errors and retryable statuses, exponential backoff with jitter."""
        import httpx

        endpoint = self.endpoint.removesuffix("/chat/completions") + path
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), _MAX_BACKOFF_S) * random.uniform(1.0, 1.25))
            try:
                response = client.post(endpoint, json=body)
            except httpx.TransportError as e:
                error = f"{type(e).__name__}: {e}"
                continue
            if response.status_code == 200:
                return _json_body(response)
            error = f"HTTP {response.status_code}: {response.text[:500]}"
            if response.status_code not in _RETRY_STATUS:
                raise ConversationError("server_error", error)
        raise ConversationError("server_error", f"{error} (gave up after {self.retries} retries)")


def chat_completions_url(url: str) -> str:
    """Accept the server's base URL, its /v1 URL or the full endpoint."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def _json_body(response) -> dict:
    try:
        return response.json()
    except ValueError as e:
        raise ConversationError("bad_response", f"response is not JSON: {response.text[:200]!r}") from e


def parse_completion(data: dict) -> tuple[str, bool]:
    """(content, cut at max_tokens) of a chat completion; separately returned reasoning is folded back in."""
    try:
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise ConversationError("bad_response", f"unexpected completion shape: {str(data)[:200]}") from e
    if isinstance(reasoning, str) and reasoning.strip():
        content = with_reasoning(content, reasoning)
    return content, choice.get("finish_reason") == "length"


def parse_text_completion(data: dict) -> tuple[str, bool]:
    """(text, cut at max_tokens) of a plain-text completion (`/v1/completions`)."""
    try:
        choice = data["choices"][0]
        text = choice["text"]
    except (KeyError, IndexError, TypeError) as e:
        raise ConversationError("bad_response", f"unexpected completion shape: {str(data)[:200]}") from e
    if not isinstance(text, str):
        raise ConversationError("bad_response", f"completion text is {type(text).__name__}")
    return text, choice.get("finish_reason") == "length"


def _answer(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def bounded_map(fn: Callable, items: Iterable, workers: int) -> Iterator[tuple]:
    """(item, fn(item)) in completion order, with at most `workers` calls running and as many queued."""
    pool = ThreadPoolExecutor(max_workers=workers)
    pending: dict[Future, object] = {}
    items = iter(items)
    try:
        for item in islice(items, 2 * workers):
            pending[pool.submit(fn, item)] = item
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                item = pending.pop(future)
                yield item, future.result()
                for nxt in islice(items, 1):
                    pending[pool.submit(fn, nxt)] = nxt
    finally:  # on an early exit (Ctrl-C), drop queued calls and do not wait for running ones
        pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------------- local backend


class LocalBackend:
    """The target itself, via transformers `generate`: left-padded batches, greedy at temperature 0.

    Conversations are batched `batch_size` at a time; within a batch, round k generates every
    conversation's k-th assistant turn in one `generate` call. While a batch generates, a worker thread
    reads the next one and encodes its first round: at batch 8192 on an H200 a third of a batch's 7.0 s
    was chat templates, tokenizing and decoding around `generate` (experiments/studies/proof_stages.py).

    cache="static": generate on transformers' StaticCache, whose decoding step transformers compiles
    and replays as a CUDA graph on a GPU: 880 conversations/s instead of 386 for the proof's 95M target
    at batch 8192 on an H200, where a dynamic-cache step took 156 ms against 39 ms for the forward
    alone (docs/results.md). Prompts are then padded to a multiple of PAD_MULTIPLE tokens, and a short
    batch (the last one, a later turn's round) is filled up with copies of its first prompt, so that
    batches share a few cache shapes (each new shape compiles again; ~13 s on the H200). Greedy
    outputs equal the dynamic cache's up to the compiled kernels' rounding: 65% of 8192 conversations
    of 128 tokens were equal.

    attention="grouped" decodes with flashdraft.model.grouped_attention, grouped-query attention
    without copying the cache to every query head (its matmul kernel; "grouped_sdpa": its SDPA kernel).
    Both need the model on transformers' sdpa. "auto" (the default) is grouped for a model on sdpa and
    the model's own attention otherwise (gpt-oss refuses sdpa: eager); `attention_name` says which
    runs. Another name sets that transformers attention implementation (sdpa, eager, flex_attention,
    ...); None keeps the model's own.
    """

    PAD_MULTIPLE = 32
    CACHES = ("dynamic", "static")

    def __init__(
        self,
        model,
        tokenizer,
        max_new_tokens: int,
        temperature: float = 0.0,
        batch_size: int = 8,
        enable_thinking: bool | None = None,
        cache: str = "dynamic",
        attention: str | None = "auto",
    ):
        from transformers import GenerationConfig

        if cache not in self.CACHES:
            raise ValueError(f"cache must be one of {self.CACHES}, not {cache!r}")
        self.cache = cache
        self.model = model.eval()
        if attention == "auto":
            attention = "grouped" if self.model.config._attn_implementation == "sdpa" else None
        if attention is not None and attention.startswith("grouped"):
            kernel = attention.removeprefix("grouped").lstrip("_") or "matmul"
            if not use_grouped_attention(self.model, kernel):
                raise ValueError(
                    f"attention={attention!r} needs the model on transformers' sdpa attention, not "
                    f"{self.model.config._attn_implementation!r}; pass attention=None to keep it"
                )
        elif attention is not None:
            self.model.set_attn_implementation(attention)
        self.attention_name = self.model.config._attn_implementation
        self.plain = not has_chat_template(tokenizer)  # prompt records continued as plain text (a base model)
        self.stop_ids = _stop_ids(model, tokenizer)
        if tokenizer.pad_token_id is None:  # batches are left-padded (masked); a copy pads with a stop id
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.pad_token_id = min(self.stop_ids)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.enable_thinking = enable_thinking
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        clear_generation_defaults(self.model)  # with top_k 0 below: softmax(logits / T) untouched
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0}
            if temperature > 0
            else {"do_sample": False}
        )
        self.generation_config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=tokenizer.pad_token_id,
            cache_implementation="static" if cache == "static" else None,
            **sampling,
        )
        self._own_cache: tuple[tuple[int, int], object] | None = None  # (rows, length), its StaticCache
        self.target_name = self.model.config._name_or_path  # `load` gives the target as the user named it

    @property
    def answer_settings(self) -> dict:
        """What the answers depend on: `regenerate_file` keeps one output file to one of these."""
        g = self.generation_config
        template = self.tokenizer.chat_template or ""
        return {
            "model": self.target_name,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            **_sampling(
                g.temperature if g.do_sample else 0.0, g.max_new_tokens, self.enable_thinking, self.plain
            ),
        }

    @classmethod
    def load(
        cls, target: str, device: str | None = None, chat_template: str | None = None, **kwargs
    ) -> LocalBackend:
        """Load a local HF directory, a hub id or a .gguf file (dtype as saved; CUDA when visible unless
        `device` says)."""
        from transformers import AutoModelForCausalLM

        from flashdraft.model.target import load_tokenizer, target_source

        tokenizer = load_tokenizer(target)
        tokenizer.chat_template = chat_template or tokenizer.chat_template
        device = default_device(device)
        source, load_kwargs = target_source(target)
        model = AutoModelForCausalLM.from_pretrained(source, dtype="auto", **load_kwargs).to(device)
        backend = cls(model, tokenizer, **kwargs)
        backend.target_name = str(Path(target).resolve()) if Path(target).exists() else target
        return backend

    def regenerate(self, conversations: list[list[dict]]) -> list[list[dict]]:
        """Every conversation with each assistant turn rewritten by the model (turn by turn)."""
        results: list[list[dict]] = []
        for start in range(0, len(conversations), self.batch_size):
            chunk = [answer_slots(c) for c in conversations[start : start + self.batch_size]]
            results += [r.messages for r in self._regenerate_batch(chunk)]
        return results

    def regenerate_each(self, conversations: Iterable[Conversation]) -> Iterator[Outcome]:
        """Batch by batch; a worker thread reads the next batch and encodes its first round (chat
        templates, tokenizing) while this one generates, so that host work overlaps the GPU's."""
        conversations = iter(conversations)
        with ThreadPoolExecutor(1, thread_name_prefix="regenerate-encode") as worker:
            ahead = worker.submit(self._next_batch, conversations)
            while (batch := ahead.result()) is not None:
                ahead = worker.submit(self._next_batch, conversations)
                yield from batch.rejected
                results = self._regenerate_or_fail(batch.slotted, batch.first_round)
                yield from zip(batch.todo, results, strict=True)

    def _next_batch(self, conversations: Iterator[Conversation]) -> _Batch | None:
        chunk = list(islice(conversations, self.batch_size))
        if not chunk:
            return None
        batch = _Batch([], [], [], None)
        for conv in chunk:
            try:
                check_regenerable(conv, self.plain, self.tokenizer)
                batch.slotted.append(answer_slots(conv.messages[:1] if self.plain else conv.messages))
                batch.todo.append(conv)
            except ConversationError as e:
                batch.rejected.append((conv, e))
        try:
            if batch.slotted:
                batch.first_round = self._encode([m[: _assistant_turns(m)[0]] for m in batch.slotted])
        except Exception as e:  # reported with the batch, as a failed generate would be
            batch.first_round = e
        return batch

    def _regenerate_or_fail(
        self, slotted: list[list[dict]], first_round: dict | Exception | None = None
    ) -> list[Regenerated | ConversationError]:
        try:
            if isinstance(first_round, Exception):
                raise first_round
            return list(self._regenerate_batch(slotted, first_round))
        except Exception as e:  # e.g. out of memory on one long batch: record it, keep the run going
            return [ConversationError("generation_error", f"{type(e).__name__}: {e}")] * len(slotted)

    def _regenerate_batch(
        self, slotted: list[list[dict]], first_round: dict | None = None
    ) -> list[Regenerated]:
        """first_round: the first round's encoding, when already made (`_encode`)."""
        turns = [_assistant_turns(msgs) for msgs in slotted]
        truncated = [0] * len(slotted)
        for k in range(max((len(t) for t in turns), default=0)):
            batch = [(c, t[k]) for c, t in enumerate(turns) if k < len(t)]
            if k == 0 and first_round is not None:
                encoded = first_round
            else:
                encoded = self._encode([slotted[c][:i] for c, i in batch])
            answers = self._generate(encoded, len(batch))
            for (c, i), (text, cut) in zip(batch, answers, strict=True):
                slotted[c][i]["content"] = text
                truncated[c] += cut
        return [Regenerated(m, t) for m, t in zip(slotted, truncated, strict=True)]

    def _encode(self, prompts: list[list[dict]]) -> dict:
        """Chat templates and tokens, left-padded, as numpy arrays (the CPU's part: a thread may run it);
        plain: the prompt records' text, with the tokenizer's own special tokens (formats.py)."""
        texts = [
            p[0]["content"]
            if self.plain
            else self.tokenizer.apply_chat_template(
                p, tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
            for p in prompts
        ]
        if self.cache == "static":  # a batch of another size would compile the decoding step again
            texts += texts[:1] * (self.batch_size - len(texts))
        return dict(
            self.tokenizer(
                texts,
                return_tensors="np",  # then torch: 1.30 s against 1.59 (experiments/studies/regen_host.py)
                padding=True,
                padding_side="left",
                add_special_tokens=self.plain,  # a template writes its own
                pad_to_multiple_of=self.PAD_MULTIPLE if self.cache == "static" else None,
            )
        )

    def _generate(self, encoded: dict, rows: int) -> list[tuple[str, bool]]:
        """Answers of the first `rows` rows of an encoded batch (the rest fill a static cache's shape)."""
        import torch

        enc = {k: torch.from_numpy(v).to(self.model.device) for k, v in encoded.items()}
        config, cache = self.generation_config, {}
        if self.cache == "static":
            own = self._windowless_cache(*enc["input_ids"].shape)
            if own is not None:  # passed in, where transformers would build its own
                config, cache = copy.copy(config), {cache_argument(self.model): own}
                config.cache_implementation = None
        with torch.no_grad():
            out = self.model.generate(**enc, generation_config=config, **cache)
        new_ids = out[:rows, enc["input_ids"].shape[1] :].tolist()
        return list(
            zip(self._decode(new_ids), [not self.stop_ids.intersection(i) for i in new_ids], strict=True)
        )

    def _windowless_cache(self, rows: int, prompt: int):
        """A static cache of full-attention layers for a batch of `rows` prompts of `prompt` tokens, when the
        model has sliding-window layers whose windows all hold the prompt and its answer; else None.

        transformers' static sliding layer counts its tokens in a Python int, which the compiled decoding
        step takes as an input. Under CUDA graphs (transformers compiles that step in reduce-overhead mode)
        each new value of an input int records a new graph: a Gemma 3 target recorded one at every step.
        A window that never binds changes nothing a full layer would not do, and a full layer counts in a
        tensor: one graph, replayed. The cache is kept for the next batch of the same shape, reset, as
        transformers keeps its own, so that the graph's addresses stay."""
        from transformers import StaticCache

        config = self.model.config.get_text_config(decoder=True)
        types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        length = prompt + self.generation_config.max_new_tokens
        if "sliding_attention" not in types or set(types) - {"sliding_attention", "full_attention"}:
            return None
        if not window or length > window:
            return None
        if self._own_cache is not None and self._own_cache[0] == (rows, length):
            self._own_cache[1].reset()
            return self._own_cache[1]
        config = copy.deepcopy(config)
        config.layer_types = ["full_attention"] * len(types)
        self._own_cache = ((rows, length), StaticCache(config=config, max_cache_len=length))
        return self._own_cache[1]

    def _decode(self, new_ids: list[list[int]]) -> list[str]:
        """The stop token and the padding after it are special, not text. A tokenizers backend decodes
        the batch in parallel (2 cores: 0.27 s for 8192 x 128 tokens, 0.37 s row by row)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not self.tokenizer.clean_up_tokenization_spaces:
            return backend.decode_batch(new_ids, skip_special_tokens=True)
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in new_ids]


@dataclass
class _Batch:
    """One batch of conversations read ahead: those to regenerate (with their answer slots), those
    rejected, and the encoded first round (or the error that encoding raised)."""

    todo: list[Conversation]
    slotted: list[list[dict]]
    rejected: list[tuple[Conversation, ConversationError]]
    first_round: dict | Exception | None


def _assistant_turns(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def _stop_ids(model, tokenizer) -> set[int]:
    ids = set(stop_token_ids(model, tokenizer))
    if not ids:
        raise ValueError("the target defines no end-of-sequence token to stop generation at")
    return ids


# --------------------------------------------------------------------------------------------------- driver


@dataclass
class RegenerateSummary:
    already_done: int  # records found in the output at start, skipped
    regenerated: int
    failed: int
    truncated_turns: int
    failed_path: Path


def failed_path_for(out_path: str | Path) -> Path:
    return Path(str(out_path) + ".failed.jsonl")


def _sampling(temperature: float, max_tokens: int, thinking: bool | None, plain: bool) -> dict:
    return {
        "temperature": temperature,
        "max_tokens": max_tokens,
        "enable_thinking": thinking,
        "plain_text": plain,
    }


def regenerate_file(
    backend,
    input_path: str,
    out_path: str | Path,
    split: str = "train",
    limit: int | None = None,
    progress: bool = True,
) -> RegenerateSummary:
    """Regenerate every record of `input_path` not yet in `out_path`, appending to it record by record.

    `backend` is a ServerBackend or LocalBackend. Failures of this run (bad input records, duplicate ids,
    server errors, empty answers) go to FILE.failed.jsonl, which is started afresh: failures of an earlier
    run are retried. When a run completes, every input record is in exactly one of the two files.
    `limit` stops after that many records (a trial run; the next run continues).
    """
    out, failed_path = Path(out_path), failed_path_for(out_path)
    if Path(input_path).exists() and out.exists() and out.resolve() == Path(input_path).resolve():
        raise ValueError(f"--out {out} is the --input: regenerated records go to another file")
    done = read_done_ids(out)
    check_settings(out, backend.answer_settings, bool(done))
    total = max(count_records(input_path, split) - len(done), 0)
    if limit is not None:
        total = min(total, limit)
    summary = RegenerateSummary(len(done), 0, 0, 0, failed_path)
    with (
        open(out, "a", encoding="utf-8") as out_file,
        open(failed_path, "w", encoding="utf-8") as failed_file,
    ):
        sink = _Sink(out_file, failed_file, summary, getattr(backend, "enable_thinking", None))
        with progress_bar("regenerate", total, progress) as advance:
            todo = _records_to_do(input_path, split, done, sink, advance)
            for conv, result in backend.regenerate_each(islice(todo, limit)):
                sink.write(conv, result)
                advance()
    return summary


class _Sink:
    """Appends results and failures as JSON lines, each flushed, and counts them."""

    def __init__(self, out_file, failed_file, summary: RegenerateSummary, thinking: bool | None = None):
        self.out_file, self.failed_file, self.summary = out_file, failed_file, summary
        self.mode = {} if thinking is None else {"enable_thinking": thinking}  # recorded for data prepare

    def write(self, conv: Conversation, result: Regenerated | ConversationError) -> None:
        if isinstance(result, Regenerated) and _empty_answer(result):
            result = ConversationError("empty_response", "the target answered a turn with nothing")
        if isinstance(result, ConversationError):
            self.fail(conv.id, conv.where, result)
            return
        record = {"id": conv.id, "messages": result.messages, "truncated_turns": result.truncated_turns}
        if conv.kind == PROMPT:  # written back in its own form: prepare reads it by the same rule
            prompt, answer = (m["content"] for m in result.messages)
            record = {
                "id": conv.id,
                "prompt": prompt,
                "completion": answer,
                "truncated_turns": record["truncated_turns"],
            }
        record |= self.mode
        _append(self.out_file, record)
        self.summary.regenerated += 1
        self.summary.truncated_turns += result.truncated_turns

    def fail(self, record_id: str, where: str, error: ConversationError) -> None:
        _append(
            self.failed_file, {"id": record_id, "where": where, "reason": error.reason, "error": str(error)}
        )
        self.summary.failed += 1


def _empty_answer(result: Regenerated) -> bool:
    return any(m["role"] == "assistant" and not m["content"].strip() for m in result.messages)


def _append(file, record: dict) -> None:
    file.write(json.dumps(record, ensure_ascii=False) + "\n")
    file.flush()


def _records_to_do(
    input_path: str, split: str, done: set[str], sink: _Sink, advance: Callable[[], None]
) -> Iterator[Conversation]:
    """Valid input conversations whose id is not in `done`; invalid or duplicate ones go to the failures."""
    seen: set[str] = set()
    for record in iter_raw_records(input_path, split):
        try:
            conv = parse_record(record, require_answers=False)
        except ConversationError as e:
            sink.fail(record.default_id, record.where, e)
            advance()
            continue
        if conv.id in seen:
            sink.fail(conv.id, record.where, ConversationError("duplicate_id", f"id {conv.id!r} seen before"))
            advance()
            continue
        seen.add(conv.id)
        if conv.id not in done:
            yield conv


def read_done_ids(path: Path) -> set[str]:
    """Ids already in the output. A last line cut short by a kill is removed, so its record is redone."""
    if not path.exists():
        return set()
    done, good_bytes = set(), 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            try:
                done.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError) as e:
                raise SourceError(f"{path}:{n}: not a record written by regenerate; fix or remove it") from e
            good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        os.truncate(path, good_bytes)
    return done
