"""Fixed-shape decoding for the eval loop, so that each forward can replay as a CUDA graph.

Why: decoding one prompt runs hundreds of small forwards, and in eager mode each costs its host
time: a one-token forward of the proof's 95M target took 23 ms on the H200 host (docs/results.md),
far above its GPU time, so a one-token forward and a 16-token verify cost the same and the eval
measures Python. A CUDA graph replays a captured forward with one launch: on the H200, plain
decoding takes 1.9 ms per token instead of 12.4 (benchmarks/decode_overhead.py, docs/results.md).
Graphs need fixed shapes and fixed addresses:

- the target keeps its KV in transformers' `StaticCache`. Before a forward at positions p..p+n-1
  every layer's write position (`cumulative_length`, a device tensor) is set to p, so rejected
  drafts need no crop: the next block overwrites them, and the causal mask, which starts at p,
  hides anything past the query;
- the drafter's context K/V live in preallocated per-layer buffers written at their positions;
  the block attends to the buffer under a mask of the filled prefix (positions before the block)
  plus the whole block.

Graphs are captured up front (`capture`), one per function and width 1..B, so that every method's
forwards replay alike (prompt lookup drafts any number of tokens) and no capture falls inside a
measured sample; the prompt runs eagerly. Prompts share the graphs: every forward writes what it
reads before reading it, so what an earlier sample or a capture left in the caches stays hidden.
On a CPU nothing is captured, which is how the tests check this path against the dynamic-cache
one. torch.compile(mode="reduce-overhead") would capture the same graphs but compiles each shape
for tens of seconds; capturing eager kernels takes milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from flashdraft.model.dflash2 import gumbel_max
from flashdraft.model.drafter import DFlashDrafter, Visibility
from flashdraft.model.target import Target


def layer_visibility(
    drafter: DFlashDrafter, mask: torch.Tensor | None, key_positions: torch.Tensor, positions: torch.Tensor
) -> Visibility | dict[str, Visibility]:
    """What a decoding block's queries see: `mask` [Q, K] (None: every key); a drafter with
    sliding_attention layers gets one per layer type, its sliding layers restricted as the z-lab format
    and the reference package define them (causal, the query's window of keys, itself included)."""
    full = Visibility(None if mask is None else mask[None, None])
    window = drafter.sliding_window
    if window is None:
        return full
    q, k = positions[:, None], key_positions[None]
    near = (k <= q) & (q - k < window)
    return {
        "full_attention": full,
        "sliding_attention": Visibility((near if mask is None else near & mask)[None, None]),
    }


def draft_hidden(
    drafter: DFlashDrafter,
    target: Target,
    block: torch.Tensor,
    positions: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    visibility: Visibility,
) -> torch.Tensor:
    """The drafter's hidden states [1, w - 1, D] of the drafts for slots 1.. of `block` [1, w] (one
    drafter forward; the anchor's row left out)."""
    embeds = target.embed(block).to(drafter.fc.weight.dtype)
    return drafter(embeds, positions, kv, visibility)[:, 1:]


def draft_logits(drafter: DFlashDrafter, target: Target, *block_and_cache) -> torch.Tensor:
    """The logits [1, w - 1, V] of the drafts (draft_hidden's arguments): the target's lm_head, then a
    DFlash2 drafter's multiplier and cap."""
    return drafter.logits(draft_hidden(drafter, target, *block_and_cache), target.lm_head)


def block_drafts(
    drafter: DFlashDrafter,
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    temperature: float,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One block's drafts from the drafter's hidden states [1, n, D] after `anchor` [1]: (tokens [1, n],
    q, support). At T = 0 the logits' argmax (DFlash) or the candidate selector's best path (DFlash2),
    q and support None. At T > 0 samples drawn by Gumbel-max from `noise` (uniform, `noise_shape`): each
    DFlash draft from softmax(logits / T), q [1, n, V]; one DFlash2 selector path, q [1, n, k] over its
    candidates `support`. A pure function of its inputs: it replays in a CUDA graph."""
    if drafter.dflash2 is not None:
        path = drafter.propose(hidden, anchor, lm_head, temperature, noise)
        return path.tokens, path.probs, None if path.probs is None else path.candidates
    logits = drafter.logits(hidden, lm_head)
    if temperature <= 0:
        return logits.argmax(-1), None, None
    scaled = logits.float() / temperature
    return gumbel_max(scaled, noise), torch.softmax(scaled, dim=-1), None


def noise_shape(drafter: DFlashDrafter, lm_head: torch.nn.Module, num_drafts: int) -> tuple[int, int, int]:
    """The uniform noise block_drafts samples from: a DFlash2 selector's top-k, or the vocabulary."""
    width = drafter.candidate_selector.top_k if drafter.dflash2 is not None else lm_head.weight.shape[0]
    return (1, num_drafts, width)


def greedy_drafts(drafter: DFlashDrafter, target: Target, *block_and_cache) -> torch.Tensor:
    """The T = 0 drafts [1, w - 1] (draft_hidden's arguments)."""
    hidden = draft_hidden(drafter, target, *block_and_cache)
    return block_drafts(drafter, target.lm_head, hidden, block_and_cache[0][:, 0], 0.0)[0]


class Graphs:
    """fn() replayed as a CUDA graph captured on its first call under (name, width); a plain call
    on a CPU. A graph's outputs are overwritten by its next replay."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self.captured: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}

    def __call__(self, name: str, width: int, fn: Callable[[], object]):
        if not self.enabled:
            return fn()
        key = (name, width)
        if key not in self.captured:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: lazy allocations, library handles
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):  # a pool of its own: no graph's outputs alias another's
                    out = fn()
            except RuntimeError as e:
                raise RuntimeError(
                    f"capturing the {name} forward (width {width}) as a CUDA graph failed: {e}; "
                    "decode without graphs (cuda_graphs=False) to measure this model"
                ) from e
            self.captured[key] = (graph, out)
        graph, out = self.captured[key]
        graph.replay()
        return out


class StaticTarget:
    """The target's forwards on a StaticCache of `max_len` positions: prefill, then blocks at a position."""

    def __init__(self, target: Target, max_len: int, graphs: Graphs):
        self.cache = StaticCache(config=target.model.config, max_cache_len=max_len)
        for i, layer in enumerate(self.cache.layers):
            # a sliding-window layer whose window holds every position decoded attends as a full one: its
            # cache is then a plain static one (the ring it would be never turns); the model's own mask
            # still limits it to its window
            if type(layer) is StaticSlidingWindowLayer and max_len <= layer.max_cache_len:
                self.cache.layers[i] = StaticLayer(max_cache_len=max_len)
        other = sorted(
            {type(layer).__name__ for layer in self.cache.layers if type(layer) is not StaticLayer}
        )
        if other:
            raise ValueError(
                f"static decoding needs a plain static KV cache in every layer; this target's has {other} "
                f"for {max_len} positions (a sliding-window layer's static cache is a ring once the "
                "positions outrun its window, and a linear-attention layer's state a running sum, neither "
                "of which a write position can rewind): decode without cuda_graphs, or fewer tokens"
            )
        self.target = target
        self.graphs = graphs
        self.start = torch.zeros((), dtype=torch.long, device=target.device)
        self.inputs: dict[int, torch.Tensor] = {}

    def _at_start(self) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(self.start)

    def prefill(self, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(last position's logits, features of every prompt token); positions from 0."""
        for layer in self.cache.layers:  # before its first write a layer's position is a CPU tensor
            layer.cumulative_length.fill_(0)
        return self.target.decode(prompt_ids, self.cache, logits_to_keep=1)

    @torch.inference_mode()  # as `generate`, which replays these graphs
    def capture(self, widths: range) -> None:
        """Every width's graph now, so that none is captured while a sample is timed (on a CPU the
        same forwards run, leaving the same junk in the cache for the samples to hide)."""
        device = self.target.device
        self.prefill(torch.zeros(1, 1, dtype=torch.long, device=device))  # allocates the cache
        for width in widths:
            self.forward(torch.zeros(1, width, dtype=torch.long, device=device), start=1)

    def keep(self, kept: int, width: int) -> None:
        """Nothing to drop: the next block overwrites the rejected positions."""

    def forward(self, block: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, features) of block [1, n] at positions start..start+n-1."""
        width = block.shape[1]
        if width not in self.inputs:
            self.inputs[width] = torch.zeros_like(block)
        ids = self.inputs[width]
        ids.copy_(block)
        self.start.fill_(start)

        def run():
            self._at_start()
            return self.target.decode(ids, self.cache)

        return self.graphs("target", width, run)


class StaticDFlashProposer:
    """DFlashProposer's drafts from fixed buffers: context K/V per layer [1, h_kv, max_len, d].

    T = 0 (`propose`): the drafts (the argmax, or DFlash2's best selector path) are taken inside the
    graph. Sampled drafts (`sample`): the prompt's generator fills a noise buffer outside the graph (one
    kernel), and the graph samples the drafts from it (block_drafts), DFlash2's whole path walk included.
    """

    def __init__(self, drafter: DFlashDrafter, target: Target, max_len: int, graphs: Graphs, block_size: int):
        target.require_taps(drafter.target_layer_ids)
        self.drafter, self.target, self.graphs = drafter, target, graphs
        self.dtype = drafter.fc.weight.dtype
        self.max_len = max_len
        self.block_size = block_size  # the decoding's, which may differ from the drafter's training one
        device = target.device
        attn = drafter.layers[0].self_attn
        shape = (1, attn.num_kv_heads, max_len, attn.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in drafter.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in drafter.layers]
        self.start = torch.zeros((), dtype=torch.long, device=device)
        width = len(drafter.target_layer_ids) * drafter.config.hidden_size
        self.features = torch.zeros(1, self.block_size, width, dtype=self.dtype, device=device)
        self.blocks: dict[int, torch.Tensor] = {}
        self.noise: dict[int, torch.Tensor] = {}  # per block width: the uniform noise of sampled drafts

    @torch.inference_mode()
    def capture(self, temperature: float = 0.0) -> None:
        """The observe graph and, per block width, a propose graph (T > 0: a sampling graph at
        `temperature`), now (see StaticTarget.capture)."""
        last = torch.zeros(1, dtype=torch.long, device=self.start.device)
        self.observe(None, self.features, start=0)
        for drafts in range(1, self.block_size):
            if temperature > 0:
                self.sample(last, 1, drafts, temperature, None)
            else:
                self.propose(last, start=1, num_drafts=drafts)

    def _write(self, features: torch.Tensor) -> None:
        """Context K/V of `features` [1, n, N*D] at positions start..start+n-1."""
        positions = self.start + torch.arange(features.shape[1], device=features.device)
        rows = self.drafter.context_kv(self.drafter.fuse(features), positions[None])
        for keys, values, (k, v) in zip(self.keys, self.values, rows, strict=True):
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)

    def observe(self, token_ids: torch.Tensor, features: torch.Tensor, start: int) -> None:
        n = features.shape[1]
        if start + max(n, self.block_size) > self.max_len:
            raise ValueError(
                f"positions {start}..{start + n - 1} do not fit the static cache of {self.max_len}"
            )
        self.start.fill_(start)
        if n > self.block_size:  # the prompt: once per sample, eagerly
            self._write(features.to(self.dtype))
            return
        # a verified block: the kept rows, then stale ones at positions the next block rewrites first
        self.features[:, :n].copy_(features)
        self.graphs("observe", self.block_size, lambda: self._write(self.features))

    def propose(self, last_token: torch.Tensor, start: int, num_drafts: int) -> torch.Tensor:
        """The T = 0 drafts [1, num_drafts] of the block after `last_token` at `start`."""
        block = self._block(last_token, start, num_drafts)
        return self.graphs("propose", block.shape[1], lambda: greedy_drafts(*self._inputs(block)))

    def sample(
        self,
        last_token: torch.Tensor,
        start: int,
        num_drafts: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sampled drafts of that block at `temperature` (block_drafts' tuple, overwritten by the next
        call); the noise is drawn with `generator` as DFlashProposer draws it."""
        block = self._block(last_token, start, num_drafts)
        width = block.shape[1]
        if width not in self.noise:
            self.noise[width] = torch.empty(noise_shape(self.drafter, self.target.lm_head, num_drafts),
                                            device=block.device)  # fmt: skip
        noise = self.noise[width].uniform_(generator=generator)

        def run():
            hidden = draft_hidden(*self._inputs(block))
            return block_drafts(self.drafter, self.target.lm_head, hidden, block[:, 0], temperature, noise)

        return self.graphs(f"sample at T = {temperature}", width, run)

    def _block(self, last_token: torch.Tensor, start: int, num_drafts: int) -> torch.Tensor:
        width = num_drafts + 1
        if width not in self.blocks:
            self.blocks[width] = last_token.new_full((1, width), self.drafter.mask_token_id)
        block = self.blocks[width]
        block[0, :1].copy_(last_token.view(1))
        self.start.fill_(start)
        return block

    def _inputs(self, block: torch.Tensor) -> tuple:
        """draft_hidden's arguments for `block` at self.start over the filled context rows."""
        width = block.shape[1]
        positions = self.start + torch.arange(width, device=block.device)
        context = torch.arange(self.max_len, device=block.device) < self.start  # filled rows
        mask = torch.cat([context.expand(width, -1), context.new_ones(width, width)], dim=1)
        kv = list(zip(self.keys, self.values, strict=True))
        keys = torch.cat([torch.arange(self.max_len, device=block.device), positions])
        vis = layer_visibility(self.drafter, mask, keys, positions)
        return self.drafter, self.target, block, positions[None], kv, vis
