"""A drafter measured in a real engine: llama.cpp's `llama-server` decoding with the exported GGUF.

Our tau comes from our own decode loop (flashdraft.eval.spec); engines are where drafters fail
silently. This module serves the target twice on 127.0.0.1, with the drafter (DFlash speculative
decoding) and without it, sends the same prompts one at a time, and reads the engine's own statistics:
drafted and accepted tokens per request from its `timings`, verify steps from `/metrics`.

Prompts are rendered and tokenized by our tokenizer (flashdraft.eval.spec.encode_prompt) and sent as
token ids, so the engine decodes exactly the ids our eval decodes.

Sampling is our eval's: the argmax at T = 0, else a sample of the plain softmax(logits / T). Each
request sets llama.cpp's sampler chain to the temperature alone (`PLAIN_SAMPLING`), which leaves out
every sampler that reshapes the distribution: its default chain cuts it with top_k 40, top_p 0.95 and
min_p 0.05 (common/common.h), and would apply penalties, DRY, XTC and typical-p where asked.

The proposal rule at T > 0 is ours too: argmax drafts, accepted while the target's sample equals them
(a one-hot proposal). In build 11434, `common_speculative_impl_draft_dflash::draft`
(common/speculative.cpp) drafts the top token of a top-k 10 sampler at each mask slot, whatever the
temperature, and fills no draft probabilities (`result_q`). The server (tools/server/server-context.cpp)
then finds `spec_draft_q` empty and verifies with `common_sampler_sample_and_accept_n`
(common/sampling.cpp): it samples the target at each slot and stops at the first sample that differs
from the draft, keeping that sample. Its rejection sampler (`common_sampler_sample_and_accept_n_rejection`,
min(1, p/q)) serves only drafters that report q.

Engine tau = 1 + accepted / verify steps (llama.cpp's "mean len"), per request, then the mean over
requests as our tau is. It counts what ours counts (tokens committed per target verify, the first
token from the prefill left out) except at the edges: llama.cpp decodes the last token of the budget
without drafts and counts no step for it, where ours counts a cycle of 1; when a stop token is the
block's last draft and accepted, it counts the bonus token sampled after it too (a stop among the
earlier drafts ends the step there, `common_sampler_sample_and_accept_n`), where ours cuts the cycle
at the stop. Drafts themselves differ where the drafter's two best logits are within about 0.01:
ggml multiplies the GGUF's bf16 matrices with activations rounded to bf16 (its CPU `vec_dot_type` for
bf16), where our eval runs the drafter in the target's dtype, f32 for an f32 target. That moves single
steps either way.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

SERVER_ENV = "FLASHDRAFT_LLAMA_SERVER"
DEFAULT_SERVER = Path.home() / ".cache/flashdraft/llama.cpp/build-portable/bin/llama-server"
STEPS_METRIC = "llamacpp:spec_decode_num_drafts_total"
# /completion's sampler chain (tools/server/server-schema.cpp, `samplers`): the temperature alone, then
# common/sampling.cpp's draw from the distribution (`llama_sampler_init_dist`); mirostat, which would
# replace the chain, is off by default
PLAIN_SAMPLING = {"samplers": ["temperature"]}
TAU_DEFINITION = (
    "engine tau = 1 + accepted drafts / verify steps (llama.cpp's mean len) per request, then the mean "
    "over requests; the last token of the budget (decoded without drafts) is no step"
)


# The target architectures whose llama.cpp graph (build 11434, src/models/*.cpp) records its layer inputs,
# which a DFlash drafter reads (`t_layer_inp`, src/llama-graph.cpp): serving a drafter for any other,
# Gemma 3 and Qwen2 among them, aborts in llama-server ("layer input tensor is null")
DFLASH_TARGETS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2", "minimax-01",
    "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35", "qwen35moe", "qwen3moe",
    "qwen3next", "qwen4exp",
})  # fmt: skip


def check_dflash_drafter(drafter: Path) -> None:
    """Refuse a --drafter that is not a DFlash drafter's GGUF, naming what it is."""
    from flashdraft.export.gguf_drafter import ARCH, gguf_architecture

    how = "export the drafter with `flashdraft export CKPT --format gguf`"
    try:
        arch = gguf_architecture(drafter, "--drafter")
    except ValueError as e:  # a directory, a checkpoint's safetensors
        raise ValueError(f"{e}; {how}") from e
    if arch != ARCH:
        raise ValueError(f"--drafter {drafter}: a GGUF of a {arch!r} model, not a DFlash drafter; {how}")


def check_dflash_target(target: Path) -> None:
    """Refuse a target GGUF whose architecture llama.cpp cannot feed a DFlash drafter (DFLASH_TARGETS), or
    a drafter's GGUF given as the target."""
    from flashdraft.export.gguf_drafter import ARCH, gguf_architecture

    arch = gguf_architecture(target, "--target")
    if arch == ARCH:
        raise ValueError(
            f"--target {target}: a DFlash drafter's GGUF, not a target (--target and --drafter swapped?)"
        )
    if arch not in DFLASH_TARGETS:
        raise ValueError(
            f"{target}: llama.cpp (build 11434) serves a DFlash drafter only for targets whose graph "
            f"records its layer inputs, and a {arch!r} target's does not (src/models/{arch}.cpp); served "
            f"targets: {', '.join(sorted(DFLASH_TARGETS))}"
        )


class ServerError(RuntimeError):
    """llama-server died, did not answer in time, or refused a request (the tail of its log is in the
    message where it stopped)."""


def find_server(path: str | Path | None = None) -> Path:
    """The llama-server binary: `path`, else $FLASHDRAFT_LLAMA_SERVER, else the one `make llama-server`
    builds."""
    server = Path(path or os.environ.get(SERVER_ENV) or DEFAULT_SERVER)
    if not server.is_file():
        raise FileNotFoundError(
            f"{server}: no llama-server there; `make llama-server` builds it into {DEFAULT_SERVER.parent} "
            f"(or name one with --server or ${SERVER_ENV})"
        )
    return server


@dataclass
class ServerOptions:
    """How llama-server runs (CPU threads, tokens drafted per step at most, context per request) and how
    long it may take to load and to answer one request."""

    threads: int = 2
    draft_max: int = 15
    ctx_size: int = 4096
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_args(binary: Path, target: Path, drafter: Path | None, port: int, opts: ServerOptions) -> list:
    args = [binary, "-m", target, "--host", "127.0.0.1", "--port", port, "-np", "1", "--metrics"]
    args += ["-c", opts.ctx_size, "-t", opts.threads, "--no-webui"]
    if drafter is not None:
        args += ["-md", drafter, "--spec-type", "draft-dflash", "--spec-draft-n-max", opts.draft_max]
        args += ["-td", opts.threads]
    return [str(a) for a in args]


class LlamaServer:
    """One llama-server process, started on enter and always stopped on exit (errors and Ctrl-C too)."""

    def __init__(self, binary: Path, target: Path, drafter: Path | None, log: Path, opts: ServerOptions):
        self.port = _free_port()
        self.args = _server_args(binary, target, drafter, self.port, opts)
        self.log = log
        self.opts = opts
        self.process: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=opts.request_timeout_s)

    def __enter__(self) -> LlamaServer:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.client.close()
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def died(self, what: str) -> ServerError:
        """The error for a server that stopped answering, with the tail of its log."""
        with contextlib.suppress(subprocess.TimeoutExpired):  # a dropped connection comes before the exit
            self.process.wait(timeout=2)
        code = self.process.poll()
        status = f"exited with code {code}" if code is not None else "is running but did not answer"
        tail = self.log.read_text(errors="replace").splitlines()[-20:]
        return ServerError(f"llama-server {status} ({what}); the end of {self.log}:\n" + "\n".join(tail))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.died("while loading")
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise self.died(f"not ready after {self.opts.startup_timeout_s:.0f} s")

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise self.died(f"{path} took over {self.opts.request_timeout_s:.0f} s") from None
        except httpx.TransportError as e:
            raise self.died(f"{path}: {e}") from None
        if response.status_code != 200:
            raise ServerError(
                f"llama-server answered {path} with {response.status_code}: {response.text[:500]}"
            )
        return response

    def steps(self) -> int:
        """Verify steps of speculative decoding so far (every finished request)."""
        for line in self._request("GET", "/metrics").text.splitlines():
            if line.startswith(STEPS_METRIC + " "):
                return int(float(line.split()[1]))
        raise ServerError(f"llama-server's /metrics has no {STEPS_METRIC}")

    def complete(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int, temperature: float = 0.0
    ) -> dict:
        """One completion of token ids sampled as our eval samples, the prompt cache off so that each
        request stands alone."""
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": temperature, "seed": seed}
        body |= PLAIN_SAMPLING | {"cache_prompt": False, "return_tokens": True, "stream": False}
        return self._request("POST", "/completion", json=body).json()


@dataclass
class Request:
    """One prompt's completion as the engine reports it."""

    tokens: list[int]
    text: str
    predicted_n: int
    predicted_ms: float
    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def tau(self) -> float:
        return 1 + self.accepted / self.steps if self.steps else math.nan


def run_requests(
    server: LlamaServer, prompts: list[list[int]], max_new_tokens: int, seed: int, temperature: float = 0.0
) -> list[Request]:
    """Each prompt in turn (one slot: the step counter's change is that request's steps)."""
    requests = []
    before = server.steps()
    for ids in prompts:
        answer = server.complete(ids, max_new_tokens, seed, temperature)
        after = server.steps()
        timings = answer["timings"]
        requests.append(
            Request(
                tokens=answer.get("tokens") or [],
                text=answer["content"],
                predicted_n=timings["predicted_n"],
                predicted_ms=timings["predicted_ms"],
                drafted=timings.get("draft_n", 0),
                accepted=timings.get("draft_n_accepted", 0),
                steps=after - before,
            )
        )
        before = after
    return requests


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def tokens_per_second(requests: list[Request]) -> float:
    """Tokens over decode time, summed over requests (the prefill excluded, as llama.cpp times it)."""
    ms = sum(r.predicted_ms for r in requests)
    return 1000 * sum(r.predicted_n for r in requests) / ms if ms else math.nan


def summarize(drafted: list[Request], plain: list[Request], greedy: bool = True) -> dict:
    """The report's figures from both runs over the same prompts; when greedy, how many completions
    with the drafter are plain decoding's (all, if the engine's speculative decoding is lossless)."""
    accepted, proposed = sum(r.accepted for r in drafted), sum(r.drafted for r in drafted)
    steps = sum(r.steps for r in drafted)
    with_drafter, without = tokens_per_second(drafted), tokens_per_second(plain)
    report = {
        "tau": _mean([r.tau for r in drafted]),
        "tau_pooled": 1 + accepted / steps if steps else math.nan,
        "tau_per_request": [None if math.isnan(r.tau) else r.tau for r in drafted],
        "acceptance_rate": accepted / proposed if proposed else math.nan,
        "drafted": proposed,
        "accepted": accepted,
        "verify_steps": steps,
        "tokens_per_s_drafter": with_drafter,
        "tokens_per_s_plain": without,
        "speedup": with_drafter / without,
        "requests": len(drafted),
    }
    if greedy:
        report["identical_to_plain"] = sum(d.tokens == p.tokens for d, p in zip(drafted, plain, strict=True))
    return report


def engine_check(
    server: Path,
    target: Path,
    drafter: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    opts: ServerOptions,
    log_dir: Path,
    seed: int = 0,
    temperature: float = 0.0,
) -> dict:
    """Serve target + drafter, then the target alone, over `prompts` (token ids); the report as a dict."""
    check_dflash_drafter(drafter)
    check_dflash_target(target)
    runs = {}
    for name, draft in (("dflash", drafter), ("plain", None)):
        with LlamaServer(server, target, draft, log_dir / f"llama-server.{name}.log", opts) as s:
            runs[name] = run_requests(s, prompts, max_new_tokens, seed, temperature)
    report = summarize(runs["dflash"], runs["plain"], greedy=temperature <= 0)
    report["tau_definition"] = TAU_DEFINITION
    report["settings"] = {"server": str(server), "target": str(target), "drafter": str(drafter)}
    report["settings"] |= {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    report["settings"] |= asdict(opts)
    report["completions"] = {name: [r.text for r in rs] for name, rs in runs.items()}
    return report


def comparison_problems(eval_report: dict, prompts: Path, num_prompts: int, settings: dict) -> list[str]:
    """Where a `flashdraft eval` report did not decode what the engine decodes: another prompts file or
    another count of its prompts (so other prompts or another order), or other `settings` (the eval
    report's keys max_new_tokens, temperature, thinking, block_size)."""
    ours = eval_report.get("settings") or {}
    problems = []
    theirs = ours.get("prompts")
    if theirs is None or not Path(theirs).is_file() or not os.path.samefile(theirs, prompts):
        problems.append(f"prompts: the eval read {theirs}, this check reads {prompts}")
    if ours.get("num_prompts") != num_prompts:
        problems.append(
            f"prompts: the eval decoded the first {ours.get('num_prompts')}, this check {num_prompts}"
        )
    problems += [
        f"{k}: the eval's {ours.get(k)}, this check's {v}" for k, v in settings.items() if ours.get(k) != v
    ]
    return problems


def beside_eval(engine: dict, eval_report: dict) -> dict:
    """Our DFlash tau (and the reference package's, if the eval ran it) beside the engine's, per prompt
    and as means over the prompts that every column measured; `engine_vs_ours` = engine / ours - 1."""
    columns = {"ours": eval_report["dflash"]["tau_per_sample"]}
    if "reference" in eval_report:
        columns["reference"] = eval_report["reference"]["tau_per_sample"]
    columns["engine"] = engine["tau_per_request"]
    rows = [dict(zip(columns, taus, strict=True)) for taus in zip(*columns.values(), strict=True)]
    measured = [r for r in rows if all(v is not None and not math.isnan(v) for v in r.values())]
    means = {name: _mean([r[name] for r in measured]) for name in columns}
    return {
        "tau": means,
        "engine_vs_ours": means["engine"] / means["ours"] - 1 if measured else math.nan,
        "prompts_measured": len(measured),
        "per_prompt": rows,
    }
