"""The DFlash drafter: a few Qwen3 layers that draft a block of tokens in one non-causal pass.

Built from transformers' Qwen3 pieces (RMSNorm, SwiGLU MLP, rotary embedding). Only the attention
is written here, because DFlash's KV injection has no counterpart in transformers: queries come
from the block alone, while keys and values are the context (fused target features) and the block,
projected by the SAME k_proj/v_proj, with k_norm and RoPE at absolute positions on every key.

The module holds exactly the weights of the z-lab checkpoint layout (layers.*, fc, hidden_norm,
norm): the target's embedding and lm_head are used by the caller and never owned here. It never
imports torch.distributed; parallelism and compilation are applied from outside. A config with
`dflash2` settings makes it a DFlash2 drafter (model/dflash2.py): a convolution around each sublayer,
a candidate selector, and the logits' multiplier and cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from flashdraft.model.dflash2 import (
    CandidateSelector,
    DFlash2Settings,
    GroupedDynamicCausalConv,
    SelectorPath,
    scale_and_cap,
)

# A tap id that means the target's token embeddings, not a layer's output: a drafter tapping only
# this sees which tokens the context holds but nothing the target computed of them (an ablation).
EMBEDDINGS = -1

# Compiled once at module level (docs/architecture.md): every call site shares one compiled kernel.
_compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
# The compiled kernel's backward on CUDA with two pipeline stages instead of torch's three: at the
# qwen3-8b drafter's shape 3.60 -> 2.97 ms a layer alone, and the two-row step's backward phase
# 168.4 -> 163.0 ms (one H200, torch 2.11; docs/results.md); gradients equal the
# default kernel's within 2e-2 (bf16).
CUDA_FLEX_OPTIONS = {"bwd_num_stages": 2}


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """N target layers spread evenly from 1 to L-3 (rounded); the middle layer when N = 1."""
    if num_taps < 1:
        raise ValueError(f"num_taps must be >= 1, got {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    ids = [round(start + i * span / (num_taps - 1)) for i in range(num_taps)]
    if len(set(ids)) != num_taps:
        raise ValueError(
            f"a target of {num_target_layers} layers has no {num_taps} distinct layers in 1..L-3: "
            "tap fewer layers (drafter.num_taps) or name them (drafter.target_layer_ids)"
        )
    return ids


@dataclass
class Visibility:
    """Which keys each query may see: a flex BlockMask, a dense bool mask [b, 1, Q, K], or None (all)."""

    mask: BlockMask | torch.Tensor | None = None
    compiled: bool = False


class Context(NamedTuple):
    """Fused context rows [b, S, D] and their RoPE: what each layer projects to its own keys and values."""

    rows: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [b, h, n, d]; cos/sin: [b, n, d]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n_heads, self.head_dim)

    def context_kv(
        self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of context rows [b, S, D] -> two [b, h_kv, S, d] (normed, rotated keys)."""
        k = self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(context), self.num_kv_heads).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        ctx_kv: tuple[torch.Tensor, torch.Tensor] | Context,
        visibility: Visibility,
    ) -> torch.Tensor:
        if isinstance(ctx_kv, Context):
            ctx_kv = self.context_kv(*ctx_kv)
        cos, sin = block_rope
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        q = _rope(q, cos, sin)
        k_blk, v_blk = self.context_kv(x, cos, sin)
        k = torch.cat([ctx_kv[0], k_blk], dim=2)
        v = torch.cat([ctx_kv[1], v_blk], dim=2)
        mask = visibility.mask
        if isinstance(mask, BlockMask):
            gqa = self.num_heads != self.num_kv_heads
            if visibility.compiled:
                opts = CUDA_FLEX_OPTIONS if q.is_cuda else None
                out = _compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=opts)
            else:
                out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
            )
        out = out.transpose(1, 2).reshape(*x.shape[:2], self.num_heads * self.head_dim)
        return self.o_proj(out)


class DFlashLayer(nn.Module):
    """Pre-norm Qwen3 block whose attention also reads the context's keys and values; in DFlash2, each
    sublayer between the two halves of a causal convolution along the block."""

    def __init__(self, config: Qwen3Config, dflash2: DFlash2Settings | None = None):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if dflash2 is not None:
            shape = (config.hidden_size, dflash2.conv_kernel_size, dflash2.conv_group_size, config.block_size)
            self.attention_conv = GroupedDynamicCausalConv(*shape)
            self.mlp_conv = GroupedDynamicCausalConv(*shape)

    def forward(self, x, block_rope, ctx_kv, visibility: Visibility) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + _convolved(self.attention_conv, self.self_attn, h, block_rope, ctx_kv, visibility)
        return x + _convolved(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))


def _convolved(conv: GroupedDynamicCausalConv | None, sublayer: nn.Module, h: torch.Tensor, *args):
    """sublayer(h, *args), between `conv`'s prepare and finish when the layer has one (DFlash2)."""
    if conv is None:
        return sublayer(h, *args)
    h, finish_kernel = conv.prepare(h)
    return conv.finish(sublayer(h, *args), finish_kernel)


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


class DFlashDrafter(nn.Module):
    """DFlash drafter (docs/dflash.md, the drafter).

    config: a Qwen3Config of the drafter with the DFlash fields `target_layer_ids`,
    `num_target_layers`, `block_size` and `mask_token_id` set as attributes, and for DFlash2 `dflash2`
    (DFlash2Settings as a dict).
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.target_layer_ids = list(config.target_layer_ids)
        self.block_size = int(config.block_size)
        self.mask_token_id = int(config.mask_token_id)
        self.dflash2 = DFlash2Settings.of(config)
        n = config.num_hidden_layers
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
        self.sliding_window = config.sliding_window if "sliding_attention" in self.layer_types else None
        if self.dflash2 is not None:
            check_dflash2(self.dflash2, config.hidden_size, config.vocab_size, self.sliding_window)
        self.layers = nn.ModuleList(DFlashLayer(config, self.dflash2) for _ in range(n))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if self.dflash2 is not None:
            d2 = self.dflash2
            self.candidate_selector = CandidateSelector(
                config.vocab_size, config.hidden_size, d2.selector_rank, d2.selector_top_k
            )

    @property
    def architecture(self) -> str:
        return "dflash" if self.dflash2 is None else "dflash2"

    def describe(self) -> str:
        """The start-up line: the drafter's shape, taps and size."""
        c = self.config
        params = sum(p.numel() for p in self.parameters())
        return (
            f"drafter ({self.architecture}): {c.num_hidden_layers} layers of width {c.hidden_size}, "
            f"{c.num_attention_heads} heads "
            f"/ {c.num_key_value_heads} key/value heads of {c.head_dim}, MLP {c.intermediate_size}, taps "
            f"{self.target_layer_ids} of {c.num_target_layers}: {_count(params)} parameters"
        )

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """Tapped target layers concatenated on the feature axis [b, S, N*D] -> context rows [b, S, D]."""
        return self.hidden_norm(self.fc(target_features))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per-layer (K, V) of fused context rows at their absolute positions; what a KV cache keeps."""
        cos, sin = self.rotary_emb(context, positions)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None,
        visibility: Visibility | dict[str, Visibility],
        target_features: torch.Tensor | None = None,
        ctx_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [b, Q, D] (after the final norm) of the block queries.

        block_embeds: target embeddings of the block tokens [b, Q, D]; block_positions [b, Q];
        visibility: over keys [context | block], or one per layer type when the drafter has
        sliding_attention layers ({"full_attention": ..., "sliding_attention": ...}). The context
        comes either as `ctx_kv` (from `context_kv`, as a KV cache holds it at inference) or, in
        training, as raw tapped `target_features` [b, S, N*D] at `ctx_positions` [b, S], fused here and
        projected by each layer.
        """
        if ctx_kv is None:
            # each layer projects the context inside its own forward, where a wrapper that gathers a
            # layer's weights around its forward (FSDP2) finds them
            context = self.fuse(target_features)
            ctx_kv = [Context(context, *self.rotary_emb(context, ctx_positions))] * len(self.layers)
        if self.sliding_window is not None and not isinstance(visibility, dict):
            raise ValueError(
                "this drafter has sliding_attention layers: give a visibility per layer type "
                "({'full_attention': ..., 'sliding_attention': ...})"
            )
        rope = self.rotary_emb(block_embeds, block_positions)
        x = block_embeds
        if torch.is_grad_enabled() and not x.requires_grad:
            # every layer's input then requires grad, as the later layers' do: a compiled layer guards on
            # it, and the first layer would otherwise compile a forward and a backward graph of its own.
            # The cost is the first layer's input gradient: ~0.4 TFLOP a qwen3-8b row, ~0.5 ms (counted)
            x = x.detach().requires_grad_()
        for layer, kv, kind in zip(self.layers, ctx_kv, self.layer_types, strict=True):
            x = layer(x, rope, kv, visibility[kind] if isinstance(visibility, dict) else visibility)
        return self.norm(x)

    @property
    def logit_scale_and_cap(self) -> tuple[float, float | None]:
        """(multiplier, softcap) of the lm_head logits: DFlash2's settings; (1, None) for DFlash."""
        if self.dflash2 is None:
            return 1.0, None
        return self.dflash2.output_multiplier, self.dflash2.final_logit_softcapping

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The drafts' logits: the target's lm_head on `hidden` (cast to its dtype), then the multiplier and
        cap (`logit_scale_and_cap`)."""
        return scale_and_cap(lm_head(hidden.to(lm_head.weight.dtype)), *self.logit_scale_and_cap)

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        lm_head: nn.Module,
        temperature: float,
        noise: torch.Tensor | None = None,
    ) -> SelectorPath:
        """DFlash2's drafts for one block: `hidden` [b, P, D] of its draft positions (slots 1.., the
        anchor's row left out), `anchor_ids` [b] its slot-0 tokens, `noise` [b, P, k] uniform at T > 0; see
        CandidateSelector.select."""
        if self.dflash2 is None:
            raise ValueError("a DFlash drafter has no candidate selector: its drafts are the logits' argmax")
        logits = self.logits(hidden, lm_head)
        return self.candidate_selector.select(hidden, logits, anchor_ids, temperature, noise)

    def reset_dflash2_to_dflash_(self) -> None:
        """DFlash2's modules set so that the drafter drafts as its DFlash part alone at T = 0: identity
        convolutions and pairwise scores of 0 (the codebooks keep their values: see reset_to_unary_)."""
        for layer in self.layers:
            layer.attention_conv.reset_to_identity_()
            layer.mlp_conv.reset_to_identity_()
        self.candidate_selector.reset_to_unary_()


def drafter_config(
    target_config,
    num_layers: int,
    target_layer_ids: list[int] | None,
    num_taps: int,
    block_size: int,
    mask_token_id: int,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    rope_theta: float | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    dflash2: DFlash2Settings | None = None,
) -> Qwen3Config:
    """The drafter's Qwen3Config. Its width is the target's (it reuses the target's embedding and lm_head
    and reads its hidden states); heads, head size, MLP width and RoPE default to the target's text config
    (the text part of a composite one) and can be set for targets whose attention does not suit a small
    drafter (an MLA target such as DeepSeek-V3 has 128 key/value heads)."""
    text = target_config.get_text_config()
    n_target = text.num_hidden_layers
    ids = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(n_target, num_taps)
    check_target_layer_ids(ids, n_target)
    heads = num_attention_heads or text.num_attention_heads
    kv_heads = num_key_value_heads or getattr(text, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"drafter: {heads} attention heads do not split into {kv_heads} key/value heads")
    inter = intermediate_size or getattr(text, "intermediate_size", None)
    if not inter:
        raise ValueError(
            f"the target config ({text.model_type}) has no intermediate_size: set drafter.intermediate_size"
        )
    cfg = Qwen3Config(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=inter,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or _target_head_dim(text, heads),
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 32768,
        rope_parameters=drafter_rope(text, rope_theta),
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=list(layer_types or ["full_attention"] * num_layers),
        sliding_window=sliding_window,
        use_sliding_window=sliding_window is not None,
    )
    cfg.target_layer_ids = ids
    cfg.num_target_layers = n_target
    cfg.block_size = block_size
    cfg.mask_token_id = mask_token_id
    if dflash2 is not None:
        check_dflash2(dflash2, cfg.hidden_size, cfg.vocab_size, sliding_window)
        cfg.dflash2 = dflash2.as_dict()
    return cfg


def check_dflash2(settings: DFlash2Settings, hidden_size: int, vocab_size: int, sliding_window) -> None:
    """DFlash2 settings that fit the drafter (ValueError naming the `drafter.*` fields otherwise)."""
    problems = settings.problems(hidden_size, vocab_size, prefix="drafter.")
    if sliding_window is not None:
        problems.append(DFLASH2_SLIDING)
    if problems:
        raise ValueError("; ".join(problems))


DFLASH2_SLIDING = (
    "DFlash2 drafters with sliding_attention layers are not supported: a DFlash2 config says is_causal "
    "false, which makes the reference's sliding windows two-sided, where ours are causal"
)


def check_target_layer_ids(ids: list[int], num_target_layers: int) -> None:
    """Taps lie in the target (or are -1, the embeddings) and never on its last layer."""
    bad = [i for i in ids if not EMBEDDINGS <= i < num_target_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} outside the target's {num_target_layers} layers (or -1)")
    if num_target_layers - 1 in ids:
        raise ValueError(LAST_LAYER.format(layer=num_target_layers - 1))


LAST_LAYER = (
    "target layer {layer} is the target's last layer, which loaders read differently (the reference dflash "
    "package reads its final-normed state, SGLang never captures it): tap an earlier layer"
)


def _target_head_dim(text, heads: int) -> int:
    head_dim = getattr(text, "head_dim", None)
    if head_dim and heads == text.num_attention_heads:
        return int(head_dim)
    return text.hidden_size // heads


# rope_parameters fields that describe positions along one axis; others (partial_rotary_factor,
# mrope_section, ...) shape how a target applies its rotary embedding, not the drafter's
_ROPE_FIELDS = (
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "truncate",
    "long_factor",
    "short_factor",
)
_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def drafter_rope(text_config, rope_theta: float | None = None) -> dict:
    """The drafter's rope_parameters from the target's, whatever their form: a flat `rope_theta`,
    `rope_parameters` (with its scaling: Llama 3's, YaRN, ...), or one set per layer kind (Gemma 3: the
    full-attention layers' are taken). `rope_theta` overrides the base (and is required for a target
    without rotary embeddings)."""
    params = dict(getattr(text_config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer kind
        params = dict(params.get("full_attention") or next(iter(params.values())))
    theta = rope_theta or params.get("rope_theta", getattr(text_config, "rope_theta", None))
    if theta is None:
        raise ValueError(
            "the target config has no rope_theta (no rotary embeddings?): set drafter.rope_theta"
        )
    if params.get("rope_type", "default") not in _ROPE_TYPES:
        params = {}
    rope = {k: params[k] for k in _ROPE_FIELDS if k in params}
    return {"rope_type": "default", **rope, "rope_theta": float(theta)}
