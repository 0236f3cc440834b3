"""The frozen target: any Hugging Face causal LM, cut after its last tapped layer.

The drafter needs the outputs of a few target layers, the target's token embedding and its lm_head.
Layers after the last tapped one are dropped from the module (never computed), and the tapped
outputs are read with forward hooks on the decoder layers rather than `output_hidden_states`,
whose last entry transformers replaces with the final-normed state.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from flashdraft.model.drafter import EMBEDDINGS


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: cannot find its decoder layers (model.layers)")
    return layers


def _set_depth(model: PreTrainedModel, layers: list[nn.Module], layer_types: list | None) -> None:
    """Give the decoder these layers; the config follows so the decoder loops over all of them."""
    decoder = model.get_decoder()
    decoder.layers = nn.ModuleList(layers)
    for config in {id(c): c for c in (model.config, decoder.config)}.values():
        config.num_hidden_layers = len(layers)
        if layer_types is not None:
            config.layer_types = layer_types[: len(layers)]


class Target:
    """A frozen causal LM that returns the outputs of layers `layer_ids` (0-based; -1 is the token
    embedding, which an ablation taps alone to train a drafter that sees no target features).

    truncate=True (training) drops every layer after max(layer_ids) from the module, so they are
    neither computed nor kept in memory; keep the full model (truncate=False) to decode with it.
    heads_only=True keeps only the embedding and lm_head (a drafter rank of a split layout).
    """

    def __init__(
        self, model: PreTrainedModel, layer_ids: list[int], truncate: bool = False, heads_only: bool = False
    ):
        model.requires_grad_(False).eval()
        self.model = model
        self.num_layers = model.config.num_hidden_layers
        layers = _decoder_layers(model)
        n = len(layers)
        if not layer_ids or max(layer_ids) >= n or min(layer_ids) < EMBEDDINGS:
            raise ValueError(f"layer ids {layer_ids} do not fit a target of {n} layers (-1: embeddings)")
        self._all_layers = list(layers)
        self._layer_types = getattr(model.config, "layer_types", None)
        if truncate or heads_only:
            keep = 0 if heads_only else max(layer_ids) + 1
            _set_depth(model, self._all_layers[:keep], self._layer_types)
            if heads_only:  # nothing will ever decode here: free the layers
                self._all_layers = []
        self.heads_only = heads_only
        self._taps: dict[int, torch.Tensor] = {}
        for i in set(layer_ids) if not heads_only else ():
            module = self.embed_tokens if i == EMBEDDINGS else layers[i]
            module.register_forward_hook(self._tap(i))
        self.layer_ids = list(layer_ids)

    def require_taps(self, layer_ids: list[int]) -> None:
        """A drafter trained on `layer_ids` reads exactly this Target's taps, or this is an error."""
        if list(self.layer_ids) != list(layer_ids):
            raise ValueError(f"target taps {self.layer_ids}, drafter expects {list(layer_ids)}")

    def _tap(self, i: int):
        def hook(_module, _inputs, output):
            self._taps[i] = output[0] if isinstance(output, tuple) else output

        return hook

    @contextlib.contextmanager
    def full_depth(self):
        """Temporarily the whole target again (a truncated Target keeps its later layers aside), e.g.
        to measure serving acceptance with speculative decoding during training."""
        if self.heads_only:
            raise RuntimeError("this Target keeps only the embedding and lm_head (heads_only=True)")
        kept = list(self.model.get_decoder().layers)
        _set_depth(self.model, self._all_layers, self._layer_types)
        try:
            yield self
        finally:
            _set_depth(self.model, kept, self._layer_types)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tapped layer outputs concatenated on the feature axis: [b, S, N*D].

        attention_mask: None (causal), or a bool [b, 1, S, S] mask (True = attend), used as is,
        e.g. to keep packed documents apart.
        """
        if self.heads_only:
            raise RuntimeError("this Target keeps only the embedding and lm_head (heads_only=True)")
        mask = {"full_attention": attention_mask} if attention_mask is not None else None
        self._taps.clear()
        self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False
        )
        return self._collect()

    @torch.no_grad()
    def decode(
        self, input_ids: torch.Tensor, past_key_values=None, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the FULL model with a KV cache (speculative decoding): (logits, features).

        Needs the whole target (truncate=False, or inside `full_depth()`). `past_key_values` (a
        transformers Cache) is updated. logits_to_keep=1 (a prefill) computes the last position's
        logits only; 0 keeps all.
        """
        self._taps.clear()
        out = self.model(
            input_ids=input_ids,
            past_key_values=past_key_values,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return out.logits, self._collect()

    def _collect(self) -> torch.Tensor:
        feats = [self._taps[i] for i in self.layer_ids]
        self._taps.clear()
        return torch.cat(feats, dim=-1)


def load_target(
    path_or_id: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, object]:
    """Load (model, tokenizer) from a local directory or a hub id: frozen, eval, bf16 on GPU and
    fp32 on CPU unless `dtype` says otherwise."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(path_or_id), dtype=dtype, attn_implementation="sdpa")
    model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(path_or_id))
    return model, tokenizer


def target_config(path_or_id: str | Path):
    return AutoConfig.from_pretrained(str(path_or_id))
