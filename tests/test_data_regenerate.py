"""`flashdraft data regenerate`: turn by turn, resumable after a kill, failures recorded, both backends."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from flashdraft.cli.data import data_app
from flashdraft.data.formats import RawRecord, parse_record
from flashdraft.data.regenerate import (
    UNTRUNCATED,
    LocalBackend,
    Regenerated,
    ServerBackend,
    chat_completions_url,
    failed_path_for,
    regenerate_file,
)
from flashdraft.data.settings import settings_path_for
from flashdraft.model.grouped_attention import NAMES


class FakeChatServer(ThreadingHTTPServer):
    """An OpenAI-compatible endpoint whose answer to a prompt is predictable: `ans{k}:{last user text}`.

    k counts the assistant turns already in the prompt, and an earlier assistant turn not written by this
    server is refused (400), so a record comes out right only if each turn saw the regenerated ones.
    Every `fail_every`-th request gets a 503; every `fail_once_every`-th distinct prompt gets a 503 the
    first time only, which retries always get through (a global count can fail one client's every
    retry when concurrent clients retry in step); `delay` slows each answer down.
    """

    def __init__(
        self, fail_every: int = 0, delay: float = 0.0, reasoning: bool = False, fail_once_every: int = 0
    ):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fail_every, self.delay, self.reasoning = fail_every, delay, reasoning
        self.fail_once_every = fail_once_every
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.prompts: set[str] = set()
        self.failures = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.requests.append(body)
            n = len(self.requests)
            prompt = json.dumps(body["messages"])
            first = prompt not in self.prompts
            self.prompts.add(prompt)
            fail_once = self.fail_once_every and first and len(self.prompts) % self.fail_once_every == 0
        if (self.fail_every and n % self.fail_every == 0) or fail_once:
            with self.lock:
                self.failures += 1
            return 503, {"error": "busy"}
        messages = body["messages"]
        earlier = [m["content"] for m in messages if m["role"] == "assistant"]
        if any(not c.startswith(("ans", "<think>")) for c in earlier):
            return 400, {"error": f"prompt holds an answer not regenerated: {earlier}"}
        time.sleep(self.delay)
        content = f"ans{len(earlier)}:{messages[-1]['content']}"
        message = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = "thinking"
        return 200, {"choices": [{"message": message, "finish_reason": "stop"}]}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.reply(*((200, {"data": [{"id": "target"}]}) if self.path == "/v1/models" else (404, {})))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/completions":  # plain text: the prompt continued by `+cont`
            self.server.requests.append(body)
            self.reply(200, {"choices": [{"text": "+cont", "finish_reason": "length"}]})
            return
        self.reply(*(self.server.answer(body) if self.path == "/v1/chat/completions" else (404, {})))

    def reply(self, status: int, reply: dict) -> None:
        payload = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def start(server: FakeChatServer) -> FakeChatServer:
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    return server


@pytest.fixture
def fake_server():
    servers = []

    def make(**kwargs) -> FakeChatServer:
        servers.append(start(FakeChatServer(**kwargs)))
        return servers[-1]

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


def conversation(i: int, turns: int) -> dict:
    messages = []
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"q{i}.{t}"},
            {"role": "assistant", "content": f"orig{i}.{t}"},
        ]
    return {"id": f"r{i}", "messages": messages}


def expected(i: int, turns: int) -> list[dict]:
    messages = []
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"q{i}.{t}"},
            {"role": "assistant", "content": f"ans{t}:q{i}.{t}"},
        ]
    return messages


def write_input(path, n: int) -> dict[str, list[dict]]:
    """n records of 1-3 turns; returns the expected regenerated messages by id."""
    path.write_text("\n".join(json.dumps(conversation(i, i % 3 + 1)) for i in range(n)) + "\n")
    return {f"r{i}": expected(i, i % 3 + 1) for i in range(n)}


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def backend(server: FakeChatServer, **kwargs) -> ServerBackend:
    options = {"max_tokens": 16, "concurrency": 4, "retries": 4, "backoff": 0.001, **kwargs}
    return ServerBackend(server.url, "target", **options)


def assert_complete(out, want: dict[str, list[dict]]) -> None:
    """Every record exactly once, with the answers the server gives when each turn sees the earlier ones."""
    rows = read_jsonl(out)
    assert sorted(r["id"] for r in rows) == sorted(want)
    assert {r["id"]: r["messages"] for r in rows} == want


def test_server_backend_regenerates_turn_by_turn_through_retries(fake_server, tmp_path):
    server = fake_server(fail_once_every=4)
    want = write_input(tmp_path / "in.jsonl", 12)
    summary = regenerate_file(
        backend(server), str(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", progress=False
    )
    assert_complete(tmp_path / "out.jsonl", want)
    assert server.failures > 0 and summary.failed == 0 and summary.regenerated == 12
    assert read_jsonl(failed_path_for(tmp_path / "out.jsonl")) == []
    assert {r["model"] for r in server.requests} == {"target"} and server.requests[0]["max_tokens"] == 16


def test_thinking_mode_and_separate_reasoning(fake_server, tmp_path):
    server = fake_server(reasoning=True)
    write_input(tmp_path / "in.jsonl", 1)
    regenerate_file(
        backend(server, enable_thinking=False), str(tmp_path / "in.jsonl"), tmp_path / "o", progress=False
    )
    assert server.requests[0]["chat_template_kwargs"] == {"enable_thinking": False}
    (row,) = read_jsonl(tmp_path / "o")
    assert row["messages"][1]["content"] == "<think>\nthinking\n</think>\n\nans0:q0.0"
    assert row["enable_thinking"] is False  # recorded: `data prepare` renders the record in this mode


def test_a_prompt_without_answer_gets_one_appended(fake_server, tmp_path):
    server = fake_server()
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"id": "p", "messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    regenerate_file(backend(server), str(tmp_path / "in.jsonl"), tmp_path / "o", progress=False)
    assert read_jsonl(tmp_path / "o")[0]["messages"][-1] == {"role": "assistant", "content": "ans0:hi"}


def test_completions_continue_prompt_records_as_plain_text(fake_server, tmp_path):
    """--completions (a base model behind the server): {"prompt"} records go to /v1/completions as they
    are and come back as {"prompt", "completion"}; a chat record is failed with its reason."""
    server = fake_server()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        json.dumps({"id": "p", "prompt": "def f(x):\n"}) + "\n" + json.dumps(conversation(1, 1)) + "\n"
    )
    args = ["regenerate", "--target", "t", "--server", server.url, "--input", str(src), "--out", str(out)]
    result = CliRunner().invoke(data_app, [*args, "--completions", "--no-progress"])
    assert result.exit_code == 1  # the chat record failed
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record == {"id": "p", "prompt": "def f(x):\n", "completion": "+cont", "truncated_turns": 1}
    assert server.requests[0]["prompt"] == "def f(x):\n" and "messages" not in server.requests[0]
    [failed] = [json.loads(line) for line in failed_path_for(out).read_text().splitlines()]
    assert failed["id"] == "r1" and failed["reason"] == "no_chat_template"


def test_server_requests_ask_for_the_targets_own_distribution(fake_server, tmp_path):
    """Every request, chat or plain text, turns off the truncation and penalties a server would otherwise
    take from the model's recommended sampling or its own defaults."""
    server = fake_server()
    write_input(tmp_path / "in.jsonl", 2)
    regenerate_file(
        backend(server, temperature=1.0), str(tmp_path / "in.jsonl"), tmp_path / "o", progress=False
    )
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "p", "prompt": "def f():"}) + "\n")
    plain = backend(server, temperature=1.0, plain=True)
    regenerate_file(plain, str(tmp_path / "p.jsonl"), tmp_path / "po", progress=False)
    assert "messages" in server.requests[0] and "prompt" in server.requests[-1]
    assert all(r["temperature"] == 1.0 and r.items() >= UNTRUNCATED.items() for r in server.requests)


def test_failures_are_recorded_with_their_reason_and_retried_by_the_next_run(fake_server, tmp_path):
    want = write_input(tmp_path / "in.jsonl", 6)
    with (tmp_path / "in.jsonl").open("a") as f:
        f.write('{"broken\n' + json.dumps(conversation(0, 1)) + "\n")  # a malformed line, then a duplicate id
    out, failed = tmp_path / "out.jsonl", failed_path_for(tmp_path / "out.jsonl")
    down = fake_server(fail_every=1)  # every request fails: every record ends in the failures
    summary = regenerate_file(backend(down, retries=2), str(tmp_path / "in.jsonl"), out, progress=False)
    assert summary.failed == 8 and read_jsonl(out) == []
    reasons = {(r["id"], r["reason"]) for r in read_jsonl(failed)}
    assert reasons == {
        *((i, "server_error") for i in want),
        ("in.jsonl:7", "malformed_json"),
        ("r0", "duplicate_id"),
    }
    assert all("HTTP 503" in r["error"] for r in read_jsonl(failed) if r["reason"] == "server_error")
    assert len(down.requests) == 6 * 3  # one try and two retries each

    summary = regenerate_file(backend(fake_server()), str(tmp_path / "in.jsonl"), out, progress=False)
    assert_complete(out, want)
    assert summary.failed == 2 and {r["reason"] for r in read_jsonl(failed)} == {
        "malformed_json",
        "duplicate_id",
    }


def test_a_request_the_server_refuses_is_not_retried(fake_server, tmp_path):
    server = fake_server()
    write_input(tmp_path / "in.jsonl", 1)
    server.answer = lambda body: (400, {"error": "context too long"})
    regenerate_file(backend(server), str(tmp_path / "in.jsonl"), tmp_path / "o", progress=False)
    (failure,) = read_jsonl(failed_path_for(tmp_path / "o"))
    assert (
        failure["reason"] == "server_error"
        and "HTTP 400" in failure["error"]
        and "context too long" in failure["error"]
    )


def test_a_line_cut_by_a_kill_is_dropped_and_its_record_redone(fake_server, tmp_path):
    want = write_input(tmp_path / "in.jsonl", 4)
    out = tmp_path / "out.jsonl"
    rows = [{"id": "r0", "messages": want["r0"], "truncated_turns": 0}, {"id": "r1", "messages": want["r1"]}]
    out.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:25])
    summary = regenerate_file(backend(fake_server()), str(tmp_path / "in.jsonl"), out, progress=False)
    assert summary.already_done == 1 and summary.regenerated == 3
    assert_complete(out, want)


def test_limit_stops_early_and_the_next_run_continues(fake_server, tmp_path):
    want = write_input(tmp_path / "in.jsonl", 10)
    server, out = fake_server(), tmp_path / "out.jsonl"
    first = regenerate_file(backend(server), str(tmp_path / "in.jsonl"), out, limit=4, progress=False)
    assert first.regenerated == 4 and len(read_jsonl(out)) == 4
    second = regenerate_file(backend(server), str(tmp_path / "in.jsonl"), out, progress=False)
    assert second.already_done == 4 and second.regenerated == 6
    assert_complete(out, want)


def test_an_output_holds_answers_of_one_setting_and_a_rerun_with_another_is_refused(fake_server, tmp_path):
    """OUT.settings.json records what the answers depend on when the first record is written; a rerun
    that changes the model, the temperature, the token limit or the thinking mode is refused, naming
    it, before any record is added; the recorded settings continue the file."""
    write_input(tmp_path / "in.jsonl", 6)
    server, out, source = fake_server(), tmp_path / "out.jsonl", str(tmp_path / "in.jsonl")
    regenerate_file(backend(server), source, out, limit=2, progress=False)
    recorded = json.loads(settings_path_for(out).read_text())
    assert recorded == {"model": "target", "temperature": 0.0, "max_tokens": 16, "enable_thinking": None,
                        "plain_text": False}  # fmt: skip
    changes = [
        ({"max_tokens": 32}, "max_tokens 16 -> 32"),
        ({"temperature": 1.0}, "temperature 0.0 -> 1.0"),
        ({"enable_thinking": False}, "enable_thinking None -> False"),
    ]
    for change, says in changes:
        with pytest.raises(ValueError, match=f"other settings .*{says}"):
            regenerate_file(backend(server, **change), source, out, progress=False)
    with pytest.raises(ValueError, match="model 'target' -> 'another'"):
        regenerate_file(ServerBackend(server.url, "another", 16), source, out, progress=False)
    assert len(read_jsonl(out)) == 2  # nothing added
    assert regenerate_file(backend(server), source, out, progress=False).regenerated == 4


def test_killed_cli_run_resumes_without_gaps_or_duplicates(fake_server, tmp_path):
    server = fake_server(fail_once_every=5, delay=0.05)
    # 30 records fit in one 8 KiB write buffer: only a flush per record puts lines in the file before the end.
    want = write_input(tmp_path / "in.jsonl", 30)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "flashdraft.cli.data", "regenerate", "--target", "target", "--server"]
    cmd += [server.url, "--input", str(tmp_path / "in.jsonl"), "--out", str(out), "--concurrency", "3"]
    cmd += ["--backoff", "0.001", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(read_jsonl_lines(out)) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert 5 <= len(read_jsonl_lines(out)) < 30

    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert_complete(out, want)


def read_jsonl_lines(path) -> list[bytes]:
    return path.read_bytes().splitlines() if path.exists() else []


def test_an_unreachable_server_is_one_clear_error_before_any_record(tmp_path):
    write_input(tmp_path / "in.jsonl", 2)
    closed = FakeChatServer()
    closed.server_close()  # the port is free again: nothing listens there
    args = ["regenerate", "--target", "t", "--server", closed.url, "--input", str(tmp_path / "in.jsonl")]
    result = CliRunner().invoke(data_app, [*args, "--out", str(tmp_path / "out.jsonl"), "--no-progress"])
    assert result.exit_code == 2 and "cannot reach the server" in result.stderr
    assert read_jsonl(tmp_path / "out.jsonl") == []


def test_server_url_forms():
    want = "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1") == chat_completions_url("http://h:1/v1/") == want
    assert chat_completions_url(want) == want


# ------------------------------------------------------------------------------------------- local backend


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir), AutoTokenizer.from_pretrained(
        tiny_target_dir
    )


def greedy(model, tokenizer, messages: list[dict], max_new_tokens: int) -> tuple[str, bool]:
    """One unpadded greedy generation: (text, cut at max_new_tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
    new = out[0, ids.shape[1] :].tolist()
    cut = tokenizer.eos_token_id not in new
    return tokenizer.decode(
        new if cut else new[: new.index(tokenizer.eos_token_id)], skip_special_tokens=True
    ), cut


def reference(model, tokenizer, messages: list[dict], max_new_tokens: int) -> Regenerated:
    """Each user turn answered alone, unbatched, after the answers already regenerated."""
    chained, cuts = [], 0
    for user in (m for m in messages if m["role"] == "user"):
        text, cut = greedy(model, tokenizer, [*chained, user], max_new_tokens)
        chained += [user, {"role": "assistant", "content": text}]
        cuts += cut
    return Regenerated(chained, cuts)


@pytest.mark.parametrize("attention", ["grouped", "grouped_sdpa", "grouped_matmul_t"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_local_backend_batches_left_padded_greedy_turn_by_turn(tiny_target, cache, attention, monkeypatch):
    from transformers import Cache, StaticCache

    model, tokenizer = tiny_target
    caches, rows = set(), set()
    forward = model.forward

    def spy(*args, **kwargs):  # the cache generate decodes on, and the batch's rows
        caches.update(type(v) for v in kwargs.values() if isinstance(v, Cache))
        rows.add(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    prompt_only = {
        "id": "p",
        "messages": [{"role": "user", "content": "a much longer question than the others"}],
    }
    records = [conversation(0, 2), prompt_only, conversation(2, 1)]
    conversations = [
        parse_record(RawRecord("in", 1, json.dumps(r).encode()), require_answers=False) for r in records
    ]
    backend = LocalBackend(model, tokenizer, max_new_tokens=4, batch_size=2, cache=cache, attention=attention)
    kernel = attention.removeprefix("grouped").lstrip("_") or "matmul"
    assert model.config._attn_implementation == NAMES[kernel]  # decoding reads each key/value head once
    results = {conv.id: result for conv, result in backend.regenerate_each(conversations)}
    assert (StaticCache in caches) == (cache == "static") and caches
    # one row short in two of the three generate calls: a static cache pads it to the batch's shape
    assert rows == ({2} if cache == "static" else {1, 2})
    caches.clear()
    model.set_attn_implementation("sdpa")  # the reference on transformers' own attention
    assert results == {r["id"]: reference(model, tokenizer, r["messages"], 4) for r in records}
    assert backend.regenerate([prompt_only["messages"]]) == [results["p"].messages]


def test_local_backend_attention_is_grouped_named_or_kept(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    messages = [{"role": "user", "content": "a question"}]
    expected = reference(model, tokenizer, messages, 6).messages  # transformers' sdpa, as loaded
    assert model.config._attn_implementation == "sdpa"
    LocalBackend(model, tokenizer, max_new_tokens=6, attention=None)
    assert model.config._attn_implementation == "sdpa"  # kept
    eager = LocalBackend(model, tokenizer, max_new_tokens=6, attention="eager")
    assert model.config._attn_implementation == "eager"
    assert eager.regenerate([messages]) == [expected]
    with pytest.raises(ValueError, match="needs the model on transformers' sdpa attention, not 'eager'"):
        LocalBackend(model, tokenizer, max_new_tokens=6, attention="grouped")
    # auto, the default: grouped on sdpa, the model's own otherwise (gpt-oss refuses sdpa), named
    assert LocalBackend(model, tokenizer, max_new_tokens=6).attention_name == "eager"
    model.set_attn_implementation("sdpa")
    assert LocalBackend(model, tokenizer, max_new_tokens=6).attention_name == "grouped_decode_matmul"
    with pytest.raises(ValueError, match="kernel must be one of"):
        LocalBackend(model, tokenizer, max_new_tokens=6, attention="grouped_flash")


def test_local_sampling_is_the_targets_own_distribution_whatever_the_model_recommends(tiny_target_dir):
    """At T = 1 every token can be drawn (generate's default top_k 50 and the model's own top_k are off);
    at T = 0 the answers are the model's argmax, a repetition penalty in its generation_config ignored."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    messages = [{"role": "user", "content": "a question"}]
    expected = reference(model, tokenizer, messages, 8).messages
    stops = [tokenizer.eos_token_id]
    model.generation_config.update(top_k=20, top_p=0.5, repetition_penalty=5.0, eos_token_id=stops)
    greedy_backend = LocalBackend(model, tokenizer, max_new_tokens=8, attention=None)
    assert greedy_backend.regenerate([messages]) == [expected]
    assert model.generation_config.eos_token_id == stops  # the stop ids stay: a later backend reads them
    forward = model.forward

    def flat(*args, **kwargs):  # every token about equally likely, in a strict order (top-k cuts ties)
        out = forward(*args, **kwargs)
        out.logits = torch.linspace(0.0, -0.5, out.logits.shape[-1]).expand_as(out.logits).contiguous()
        return out

    model.forward = flat
    model.generation_config.update(top_k=20, top_p=0.5)
    torch.manual_seed(0)
    sampled = LocalBackend(
        model, tokenizer, max_new_tokens=1, temperature=1.0, batch_size=400, attention=None
    )
    answers = {c[-1]["content"] for c in sampled.regenerate([messages] * 400)}
    # 400 draws of 384 about equally likely tokens: over 200 distinct; generate's default top_k: 50 at most
    assert len(answers) > 100


@pytest.mark.parametrize("window", [64, 16])
def test_a_static_cache_decodes_sliding_layers_as_full_ones_while_the_window_holds_every_position(
    tiny_tokenizer, window
):
    """Prompts padded to 32 tokens and 6 new ones fit a window of 64: the static cache is flashdraft's,
    all full layers (transformers' sliding layer counts in a Python int, and CUDA graphs record a new
    graph for each value), kept between batches of one shape; the answers are the dynamic cache's. A
    window of 16 binds: transformers builds its own cache, sliding layers and all."""
    from families import family_config

    tok = tiny_tokenizer
    config = family_config("gemma3_text", len(tok), tok.eos_token_id, tok.pad_token_id or 0)
    config.sliding_window = window
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("sdpa")
    conversations = [
        [{"role": "user", "content": "hello there"}],
        [{"role": "user", "content": "a question"}],
    ]
    expected = LocalBackend(model, tok, max_new_tokens=6, batch_size=2).regenerate(conversations)
    seen, forward = [], model.forward

    def spy(*args, **kwargs):  # the cache each forward decodes on
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append((id(cache), {type(layer).__name__ for layer in cache.layers}))
        return forward(*args, **kwargs)

    model.forward = spy
    static = LocalBackend(model, tok, max_new_tokens=6, batch_size=2, cache="static")
    assert static.regenerate(conversations) == expected
    assert static.regenerate(conversations[::-1]) == expected[::-1]
    layers = set().union(*(kinds for _, kinds in seen))
    if window == 64:
        assert layers == {"StaticLayer"} and len({cache for cache, _ in seen}) == 1
    else:
        assert "StaticSlidingWindowLayer" in layers


def test_local_backend_rejects_an_unknown_cache(tiny_target):
    with pytest.raises(ValueError, match="cache must be one of"):
        LocalBackend(*tiny_target, max_new_tokens=4, cache="paged")


def test_cli_local_backend_regenerates_a_file(tiny_target_dir, tmp_path):
    write_input(tmp_path / "in.jsonl", 3)
    args = ["regenerate", "--target", str(tiny_target_dir), "--input", str(tmp_path / "in.jsonl")]
    args += ["--out", str(tmp_path / "out.jsonl"), "--max-tokens", "4", "--batch-size", "2", "--no-progress"]
    result = CliRunner().invoke(data_app, args)
    rows = read_jsonl(tmp_path / "out.jsonl")
    failures = read_jsonl(failed_path_for(tmp_path / "out.jsonl"))
    assert sorted(r["id"] for r in rows + failures) == ["r0", "r1", "r2"]
    assert result.exit_code == (1 if failures else 0), result.output
    assert all(r["truncated_turns"] >= 0 and r["messages"][0]["content"].startswith("q") for r in rows)
    # the same target named by another path continues the file; another token limit is refused
    relative = os.path.relpath(tiny_target_dir)
    again = CliRunner().invoke(data_app, [*args[:2], relative, *args[3:]])
    assert again.exit_code == (1 if failures else 0), again.output
    args[args.index("--max-tokens") + 1] = "8"
    refused = CliRunner().invoke(data_app, args)
    assert refused.exit_code == 2 and "max_tokens 4 -> 8" in refused.output


def test_local_backend_decodes_a_batch_as_its_tokenizer_does(tiny_target):
    model, tokenizer = tiny_target
    backend = LocalBackend(model, tokenizer, max_new_tokens=4)
    text = "def f(x):\n    return x  # é"
    specials = [t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] + specials, specials]
    assert backend._decode(ids) == [text, ""]
    assert backend._decode(ids) == [tokenizer.decode(i, skip_special_tokens=True) for i in ids]


def test_local_backend_encodes_the_next_batch_while_this_one_generates(tiny_target, monkeypatch):
    model, tokenizer = tiny_target
    backend = LocalBackend(model, tokenizer, max_new_tokens=2, batch_size=1)
    encoded: list[int] = []
    second_encoded = threading.Event()
    encode, generate = backend._encode, model.generate

    def spy_encode(prompts):
        out = encode(prompts)
        encoded.append(len(prompts))
        if len(encoded) == 2:
            second_encoded.set()
        return out

    waited: list[bool] = []

    def spy_generate(*args, **kwargs):  # the first batch waits for the second's encoding
        if not waited:
            waited.append(second_encoded.wait(timeout=20))
        return generate(*args, **kwargs)

    monkeypatch.setattr(backend, "_encode", spy_encode)
    monkeypatch.setattr(model, "generate", spy_generate)
    records = [conversation(i, 1) for i in range(3)]
    convs = [parse_record(RawRecord("in", i + 1, json.dumps(r).encode())) for i, r in enumerate(records)]
    results = {conv.id: result for conv, result in backend.regenerate_each(convs)}
    assert waited == [True]  # encoded ahead, while the first batch generated
    assert encoded == [1, 1, 1]  # each batch once: the first round comes from the worker
    assert results == {r["id"]: reference(model, tokenizer, r["messages"], 2) for r in records}


def test_a_tokenizer_without_a_pad_token_pads_with_a_stop_id_and_is_left_as_it_was(tiny_target):
    """A tokenizer converted from GGUF by transformers 5.17 has no pad token: batches still left-pad
    (masked), and the caller's tokenizer is not changed."""
    import copy

    model, tokenizer = tiny_target
    padless = copy.deepcopy(tokenizer)
    padless.pad_token = None
    backend = LocalBackend(model, padless, max_new_tokens=4, batch_size=2)
    assert padless.pad_token_id is None
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a longer question"}]]
    answers = backend.regenerate(prompts)
    assert answers == LocalBackend(model, tokenizer, max_new_tokens=4, batch_size=2).regenerate(prompts)
    assert backend.generation_config.pad_token_id == min(backend.stop_ids)
