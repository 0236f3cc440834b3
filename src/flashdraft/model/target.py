"""The frozen target: any Hugging Face decoder-only causal LM, read through the model's own interfaces.

The drafter needs the outputs of a few target layers, the target's token embedding and its lm_head.
All three are found the way transformers exposes them for every family: `get_decoder()` and its list of
decoder layers (the one nn.ModuleList as long as the text config's `num_hidden_layers`),
`get_input_embeddings()`, `get_output_embeddings()`, and `config.get_text_config()` for composite
(multimodal) configs such as Gemma3ForConditionalGeneration's. Tapped outputs are read with forward
hooks on the decoder layers rather than `output_hidden_states`, whose last entry transformers replaces
with the final-normed state. For training features the forward stops right after the last tapped layer
(its hook raises), so later layers and the lm_head cost nothing; the hooks live for one forward and the
loaded model is never changed: the same object decodes in eval. `load_target(layers=N)` builds the model
with only its first N decoder layers, so a run that taps up to layer N - 1 (or, at N = 0, a drafter rank
of a split layout, which needs only the embedding and lm_head) never holds the rest in memory.

Packed rows hold documents end to end, positions restarting at 0 in each. How a target keeps them apart
is measured once at start-up (`choose_packing`), not assumed per family:
- "positions": the model builds its own masks from the position ids (document-causal, restricted to the
  window in sliding-window layers, in the format of its attention implementation), as transformers does
  for packed sequences (Qwen3, Llama, Mistral, Qwen3-MoE, Gemma 3, Phi-3, ...);
- "masks": the model ignores position ids when it builds masks but accepts a mapping of masks per layer
  kind (gpt-oss): transformers' own mask builders make them here from the position ids;
- "one_document": no mask keeps documents apart, because some layers carry state from token to token
  (linear attention such as Qwen3-Next's Gated DeltaNet, whose reference kernels ignore sequence
  boundaries; Mamba-style layers): the packer then puts one document per row.
The probe is structural, hence exact in any dtype: the gradient of the second document's tapped features
with respect to the first document's input embeddings is zero exactly when nothing leaks (masked attention
weights are exact zeros) and non-zero otherwise.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import struct
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from flashdraft.model import varlen_attention
from flashdraft.model.drafter import EMBEDDINGS

PACKINGS = ("positions", "masks", "one_document")


class _Stop(Exception):
    """Raised by the last tapped layer's hook to end a features forward there."""


def decoder_layers(model: PreTrainedModel) -> tuple[nn.Module, str, nn.ModuleList]:
    """(the decoder, the attribute name, the list) of the model's decoder layers."""
    decoder = model.get_decoder()
    depth = model.config.get_text_config().num_hidden_layers
    found = [
        (name, m) for name, m in decoder.named_children() if isinstance(m, nn.ModuleList) and len(m) == depth
    ]
    if len(found) != 1:
        raise TypeError(
            f"{type(model).__name__}: cannot find its decoder layers (one nn.ModuleList of {depth} layers "
            f"in {type(decoder).__name__}; found {[n for n, _ in found]})"
        )
    return decoder, *found[0]


def cache_argument(model: PreTrainedModel) -> str:
    """The name of the model forward's KV-cache argument: transformers 5.24 renamed past_key_values to
    cache (in `generate`'s keyword arguments too)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def layer_kinds(config) -> list[str]:
    """The attention kind of every layer of text config `config`: its `layer_types`, or for a config
    without them (Mistral, Phi-3), sliding_attention in every layer where it sets a sliding window."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def _mask_builders() -> dict:
    from transformers import masking_utils as mu

    return {
        "full_attention": mu.create_causal_mask,
        "sliding_attention": mu.create_sliding_window_causal_mask,
        "chunked_attention": mu.create_chunked_causal_mask,
    }


def embedding_scale(embedding: nn.Module) -> float:
    """The factor a target's input-embedding module multiplies its rows by in its forward: transformers'
    scaled embeddings (Gemma 1 to 4) keep it exactly as `scalar_embed_scale` (sqrt(hidden_size)); their
    `embed_scale` buffer holds it in the model's dtype, rounded. A plain lookup scales by 1. A module with
    an `embed_scale` but no exact value is refused rather than guessed."""
    scale = getattr(embedding, "scalar_embed_scale", None)
    if scale is not None:
        return float(scale)
    if hasattr(embedding, "embed_scale"):
        raise TypeError(
            f"{type(embedding).__name__} scales its rows (embed_scale) without the exact factor "
            "(scalar_embed_scale): flashdraft cannot tell what a drafter's block input must be"
        )
    return 1.0


class Target:
    """A frozen causal LM that returns the outputs of layers `layer_ids` (0-based; -1 is the token
    embedding, which an ablation taps alone to train a drafter that sees no target features).

    packing: how `features` keeps the documents of a packed row apart (the module docstring);
    `choose_packing` measures which one the model needs. config: the whole target's config when `model`
    holds only its first layers (`load_target(layers=...)`): features then run on those, and decoding
    needs them all. The model is read, never changed: taps are forward hooks that live for one forward.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: list[int], packing: str = "positions", config=None):
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, not {packing!r}")
        model.requires_grad_(False).eval()
        self.model = model
        self.config = model.config.get_text_config()  # of the layers loaded, in the attention they run
        self.whole_config = (config or model.config).get_text_config()
        self._cache_arg = cache_argument(model)
        self.decoder, _, self._layers = decoder_layers(model)
        self.num_layers = self.whole_config.num_hidden_layers
        if not layer_ids or max(layer_ids) >= self.num_layers or min(layer_ids) < EMBEDDINGS:
            raise ValueError(
                f"layer ids {layer_ids} do not fit a target of {self.num_layers} layers (-1: embeddings)"
            )
        self.layer_ids = list(layer_ids)
        self.packing = packing
        self._taps: dict[int, torch.Tensor] = {}
        self._last = max(layer_ids)

    @property
    def loaded_layers(self) -> int:
        """How many of the target's decoder layers `model` holds (the first ones)."""
        return len(self._layers)

    def _needs(self, layers: int, what: str) -> None:
        if self.loaded_layers < layers:
            raise RuntimeError(
                f"{what} needs the target's first {layers} layers; this model holds {self.loaded_layers} "
                f"of {self.num_layers} (load_target(layers=...))"
            )

    @contextlib.contextmanager
    def _tapping(self, stop: bool):
        """Hooks that keep the tapped outputs for this forward (and, with `stop`, end it at the last)."""

        def tap(i: int):
            def hook(_module, _inputs, output):
                self._taps[i] = output[0] if isinstance(output, tuple) else output
                if stop and i == self._last:
                    raise _Stop

            return hook

        hooks = [
            (self.embed_tokens if i == EMBEDDINGS else self._layers[i]).register_forward_hook(tap(i))
            for i in set(self.layer_ids)
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def require_taps(self, layer_ids: list[int]) -> None:
        """A drafter trained on `layer_ids` reads exactly this Target's taps, or this is an error."""
        if list(self.layer_ids) != list(layer_ids):
            raise ValueError(f"target taps {self.layer_ids}, drafter expects {list(layer_ids)}")

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def embedding_scale(self) -> float:
        """The factor the target's embedding module applies to its rows (`embedding_scale`)."""
        return embedding_scale(self.embed_tokens)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The drafter's block input: rows of the target's embedding table times `embedding_scale`
        (Gemma's sqrt(hidden_size), 1 for the other families), what the engines feed a DFlash drafter.
        llama.cpp (build 11434) looks the target's table up and multiplies by the drafter GGUF's
        `dflash.embedding_scale` (src/models/dflash.cpp), which its converter sets to sqrt(hidden_size)
        for a Gemma target (conversion/qwen.py, DFlashModel.set_gguf_parameters), as our export does;
        the reference package's MLX backend multiplies by the target's own `embed_scale`. The factor is
        a Python float, so the product is computed in f32 and rounded once, as llama.cpp's f32 scale is
        (the module's own forward multiplies by its scale rounded to the table's dtype first)."""
        rows = F.embedding(input_ids, self.embed_tokens.weight)
        scale = self.embedding_scale
        return rows if scale == 1.0 else rows * scale

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, final: bool = False
    ):
        """Tapped layer outputs concatenated on the feature axis: [b, S, N*D].

        position_ids None: each row is one document at positions 0.. (plain causal attention). Given,
        they restart at 0 in each document of a packed row, which keeps the documents apart
        (`packing`); padding sits at position 0 and sees only itself. final: every layer runs, and the
        result is (features, the final normed hidden state [b, S, D]) (soft-label distillation).
        """
        self._needs(
            self.num_layers if final else self._last + 1, "the final hidden state" if final else "features"
        )
        return self._features(self.packing, position_ids, final, input_ids=input_ids)

    def _features(self, packing: str, position_ids: torch.Tensor | None, final: bool = False, **inputs):
        """One forward up to the last tapped layer (every layer when `final`), from `input_ids` or
        `inputs_embeds`."""
        self._taps.clear()
        if packing == "masks" and position_ids is not None and "input_ids" in inputs:
            inputs["inputs_embeds"] = self.embed_tokens(inputs.pop("input_ids"))  # the mask builders need it
        if "inputs_embeds" in inputs:  # what the embedding's tap sees when the model embeds the ids itself
            self._taps[EMBEDDINGS] = inputs["inputs_embeds"]
        kwargs = {}
        if packing == "masks" and position_ids is not None:
            kwargs["attention_mask"] = self._masks(inputs["inputs_embeds"], position_ids)
        documents = contextlib.nullcontext()
        if self.config._attn_implementation == varlen_attention.NAME:  # the documents' lengths, once
            first = next(iter(inputs.values()))
            documents = varlen_attention.documents(position_ids, first.shape[:2], first.device)
        with self._tapping(stop=not final), documents:
            try:
                out = self.decoder(**inputs, position_ids=position_ids, use_cache=False, **kwargs)
            except _Stop:
                out = None
        feats = self._collect()
        return (feats, out.last_hidden_state) if final else feats

    def mask_kinds(self) -> set[str] | None:
        """The model's attention kinds when transformers can build a mask for each of them, else None."""
        kinds = set(layer_kinds(self.config))
        return kinds if kinds <= _mask_builders().keys() else None

    def _masks(self, embeds: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """Per layer kind, the mask transformers builds for packed sequences from the position ids."""
        builders = _mask_builders()
        return {
            kind: builders[kind](self.config, embeds, None, None, position_ids) for kind in self.mask_kinds()
        }

    def leaks(self, packing: str, length: int = 16) -> bool:
        """Whether, packed under `packing`, the second of two documents in a row depends on the first."""
        vocab = self.embed_tokens.weight.shape[0]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (1, 2 * length), generator=g).to(self.device)
        positions = torch.arange(length, device=self.device).repeat(2)[None]
        with torch.enable_grad():
            embeds = self.embed_tokens(ids).detach().requires_grad_(True)
            feats = self._features(packing, positions, inputs_embeds=embeds)
            (grad,) = torch.autograd.grad(feats[:, length:].float().sum(), embeds)
        return bool(grad[:, :length].ne(0).any())

    @torch.no_grad()
    def decode(
        self, input_ids: torch.Tensor, past_key_values=None, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the whole model with a KV cache (speculative decoding): (logits, features).

        `past_key_values` (a transformers Cache) is updated. logits_to_keep=1 (a prefill) computes the
        last position's logits only; 0 keeps all.
        """
        self._needs(self.num_layers, "decoding")
        self._taps.clear()
        with self._tapping(stop=False):
            out = self.model(
                input_ids=input_ids,
                **{self._cache_arg: past_key_values},
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        return out.logits, self._collect()

    def _collect(self) -> torch.Tensor:
        feats = [self._taps[i] for i in self.layer_ids]
        self._taps.clear()
        return torch.cat(feats, dim=-1)

    def describe(self) -> str:
        """The start-up line: which model, which attention and experts code, how rows are packed."""
        kinds = layer_kinds(self.whole_config)
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
        loaded = f"; the first {self.loaded_layers} loaded" if self.loaded_layers < self.num_layers else ""
        parts = [
            f"target {type(self.model).__name__} ({self.num_layers} layers: {counts}{loaded})",
            f"attention {self.config._attn_implementation}",
        ]
        experts = getattr(self.config, "_experts_implementation", None)
        if experts and has_experts(self.model):
            parts.append(f"experts {experts}")
        parts.append(f"packed rows: {PACKING_LINES[self.packing]}")
        return "; ".join(parts)


PACKING_LINES = {
    "positions": "documents kept apart by position ids",
    "masks": "documents kept apart by per-layer masks built from position ids",
    "one_document": "one document per row",
}


def has_experts(model: nn.Module) -> bool:
    return any(type(m).__name__.endswith("Experts") for m in model.modules())


def choose_packing(model: PreTrainedModel, layer_ids: list[int]) -> str:
    """The first packing under which the documents of a row do not see each other (module docstring),
    probed on the forward that training runs (up to the last of `layer_ids`)."""
    probe = Target(model, layer_ids)
    try:
        if not probe.leaks("positions"):
            return "positions"
    except NotImplementedError as e:  # flex_attention's backward on a CPU
        attention = model.config._attn_implementation
        raise ValueError(
            f"the packing probe differentiates through the target, which its attention ({attention}) "
            f"cannot do here: {e}. Choose another target attention, or data.one_document_per_row: true"
        ) from e
    if probe.mask_kinds() is not None:
        try:
            if not probe.leaks("masks"):
                return "masks"
        except (TypeError, AttributeError, KeyError, ValueError):  # the model takes no mask mapping
            pass
    return "one_document"


def target_source(path_or_id: str | Path) -> tuple[str, dict]:
    """(what `from_pretrained` takes, its keyword arguments) for a target given as a local directory, a
    hub id or a `.gguf` file (transformers dequantizes GGUF weights on load, with the `gguf` and
    `accelerate` packages; the tokenizer and its chat template come from the file too)."""
    path = Path(str(path_or_id))
    if path.suffix != ".gguf":
        return str(path_or_id), {}
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    return str(path.parent), {"gguf_file": path.name}


_gguf_readers: dict | None = None  # while a GGUF target loads: its file's parsed metadata, shared


@contextlib.contextmanager
def _gguf_parsed_once(path_or_id: str | Path):
    """While a GGUF target loads, each `gguf.GGUFReader(path)` returns the reader of the first parse.

    transformers parses the whole file again for the config, for the tokenizer and for the weights, and
    the tokenizer checks below read it once more. gguf's reader builds a view per element of the
    metadata arrays: for Gemma 3's 262,144-token vocabulary that is about 15 s a parse on one core, four
    times over. The readers are read-only memory maps, so one serves every caller. Nested loads (the
    tokenizer inside `load_target`) share the outer one's readers."""
    global _gguf_readers
    if Path(str(path_or_id)).suffix != ".gguf" or _gguf_readers is not None:
        yield
        return
    import gguf

    parse, _gguf_readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in _gguf_readers:
            _gguf_readers[key] = parse(path, mode)
        return _gguf_readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader, _gguf_readers = parse, None


def load_tokenizer(path_or_id: str | Path):
    with _gguf_parsed_once(path_or_id):
        source, kwargs = target_source(path_or_id)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        except (ValueError, struct.error) as e:
            if "gguf_file" not in kwargs:
                raise
            raise _unreadable_gguf(path_or_id, e) from e
        if "gguf_file" in kwargs:
            import gguf

            path = Path(str(path_or_id))
            fields = gguf.GGUFReader(path).fields
            _refuse_a_unigram_build(tokenizer, fields, path)
            _add_specials_as_the_file_says(tokenizer, fields, path)
        return tokenizer


def _refuse_a_unigram_build(tokenizer, fields, path: Path) -> None:
    """llama.cpp tokenizes a file whose `tokenizer.ggml.model` is "llama" (a SentencePiece vocabulary)
    by merging pairs best-first, as BPE does. transformers 5.17 builds Gemma's as Unigram instead, which
    cuts text into other pieces (" These should" into 23 ids rather than 2): the model, fed ids it was
    not trained on, writes "1. 1. 1. ..." Such a build is refused rather than used."""
    field = fields.get("tokenizer.ggml.model")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if field is None or backend is None or field.contents() != "llama":
        return
    if type(backend.model).__name__ == "Unigram":
        import transformers

        raise ValueError(
            f"{path}: transformers {transformers.__version__} builds this file's SentencePiece tokenizer "
            "as Unigram, which splits text unlike llama.cpp and the model's training (BPE merges); "
            "transformers 5.18 or later builds it right: pip install 'transformers>=5.18'"
        )


def _add_specials_as_the_file_says(tokenizer, fields, path: Path) -> None:
    """A GGUF tokenizer adds <bos> (or <eos>) to a text as the file's `tokenizer.ggml.add_bos_token`
    says: llama.cpp does, and a Gemma prompt without <bos> is out of distribution. transformers does
    not always carry the flag over (5.17 builds Gemma's tokenizer without it, 5.24 with it), so it is
    set here from the file, and a tokenizer that still disagrees is an error."""
    for role in ("bos", "eos"):
        field = fields.get(f"tokenizer.ggml.add_{role}_token")
        token_id = getattr(tokenizer, f"{role}_token_id")
        if field is None or token_id is None:
            continue
        wanted = bool(field.contents())
        ids = tokenizer("a", add_special_tokens=True).input_ids
        if (ids[0 if role == "bos" else -1] == token_id) != wanted:
            setattr(tokenizer, f"add_{role}_token", wanted)
            ids = tokenizer("a", add_special_tokens=True).input_ids
        if (ids[0 if role == "bos" else -1] == token_id) != wanted:
            raise ValueError(
                f"{path}: the file says add_{role}_token={wanted}, and its tokenizer as transformers "
                f"builds it ({type(tokenizer).__name__}) cannot be made to"
            )


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def clear_generation_defaults(model: PreTrainedModel) -> None:
    """Give the model a generation_config that keeps only its special token ids (where generation
    stops: `stop_token_ids` reads them), so that `generate` applies only what its caller passes and
    transformers' own defaults, top_k 50 among them (pass top_k=0 to sample the whole distribution).
    A checkpoint's recommended sampling (Qwen3's: top_k 20, top_p 0.95) or repetition penalty would
    otherwise apply unasked, and a penalty changes even greedy decoding."""
    from transformers import GenerationConfig

    ids = {k: getattr(model.generation_config, k, None) for k in _TOKEN_IDS}
    model.generation_config = GenerationConfig(**{k: v for k, v in ids.items() if v is not None})


def default_device(device: str | None = None) -> str:
    """`device` when given, else cuda when a GPU is visible, else cpu: every command's default."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def stop_token_ids(model: PreTrainedModel, tokenizer=None) -> list[int]:
    """The ids generation stops at: the generation config's end-of-sequence ids and the tokenizer's
    (regeneration, eval and the reference package all stop at these)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def load_target(
    path_or_id: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    attention: str = "auto",
    layers: int | None = None,
) -> tuple[PreTrainedModel, object]:
    """Load (model, tokenizer) from a local directory, a hub id or a .gguf file: frozen, eval, bf16 on GPU
    and fp32 on CPU unless `dtype` says otherwise.

    attention: "auto" takes the model's own choice, which transformers makes per model class: sdpa where
    the model supports it, else eager (gpt-oss); `Target.describe` says which runs. Any other name is
    required as given (transformers refuses one the model does not support).
    layers: build the model with only its first `layers` decoder layers and load only their weights (and
    the embedding, final norm and lm_head): a features forward that stops at layer `layers - 1` needs no
    more, and 0 keeps the embedding and lm_head alone. The model's config then says `layers`; give
    `Target` the whole target's (`target_config`). None: every layer. A weight the model expects and the
    checkpoint lacks is an error, as is one the checkpoint has and the model does not use (other than
    the layers left out).
    """
    with _gguf_parsed_once(path_or_id):
        return _load_target(path_or_id, device, dtype, attention, layers)


def _load_target(path_or_id, device, dtype, attention, layers) -> tuple[PreTrainedModel, object]:
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    source, kwargs = target_source(path_or_id)
    if attention != "auto":
        kwargs["attn_implementation"] = attention
    config = target_config(path_or_id)
    depth = config.get_text_config().num_hidden_layers
    if layers is not None and not 0 <= layers <= depth:
        raise ValueError(f"{path_or_id}: layers={layers}, the target has {depth}")
    if layers is not None and layers < depth:
        config = first_layers_config(config, layers)
    try:
        with _quiet_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(
                source, config=config, dtype=dtype, output_loading_info=True, **kwargs
            )
    except OSError as e:  # no such directory, no config.json, not on the hub (offline)
        raise ValueError(f"{path_or_id}: not a model transformers can load ({str(e).splitlines()[0]})") from e
    except ValueError as e:
        if attention == "auto":
            raise
        raise ValueError(f"{path_or_id}: target attention {attention!r}: {e}") from e
    _check_loaded(path_or_id, model, info, layers if layers is not None and layers < depth else None)
    model.to(device)
    return model, load_tokenizer(path_or_id)


def first_layers_config(config, layers: int):
    """A copy of `config` whose (text) model has only the first `layers` decoder layers, its per-layer
    list of attention kinds cut to match."""
    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:layers]
    return config


@contextlib.contextmanager
def _quiet_load_report():
    """transformers' load report lists the weights of the layers a partial load leaves out as unexpected:
    `_check_loaded` judges the report instead."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _check_loaded(path_or_id, model: PreTrainedModel, info: dict, layers: int | None) -> None:
    """Every weight the model expects came from the checkpoint in its shape (else an error: it would be
    left at random); weights the checkpoint holds and the model does not use are named in a warning,
    except (with `layers`) those of the decoder layers from `layers` on."""
    _, attr, _ = decoder_layers(model)
    unused = [k for k in info.get("unexpected_keys", ()) if not left_out(k, attr, layers)]
    if unused:
        warnings.warn(
            f"{path_or_id}: weights {type(model).__name__} does not use: {named_keys(unused)}", stacklevel=3
        )
    problems = {
        "missing from the checkpoint": info.get("missing_keys", ()),
        "of another shape": info.get("mismatched_keys", ()),
    }
    problems = [f"{k}: {named_keys(v)}" for k, v in problems.items() if v]
    if problems:
        raise ValueError(
            f"{path_or_id}: the weights do not fit {type(model).__name__} ({'; '.join(problems)})"
        )


def left_out(key: str, attr: str, layers: int | None) -> bool:
    """Whether checkpoint key `key` is a weight of a decoder layer (in the list named `attr`) at index
    `layers` or later: one a partial load leaves out (never, with `layers` None)."""
    m = re.search(rf"\.{re.escape(attr)}\.(\d+)\.", key)
    return layers is not None and m is not None and int(m.group(1)) >= layers


def named_keys(keys) -> str:
    """The first few of `keys`, sorted, for a message."""
    keys = sorted(str(k) for k in keys)
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def target_config(path_or_id: str | Path):
    """The target's whole config; a path or id that names no model is an error that says so."""
    source, kwargs = target_source(path_or_id)
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except OSError as e:  # no such directory, no config.json, not on the hub (offline)
        raise ValueError(f"{path_or_id}: not a model transformers can load ({str(e).splitlines()[0]})") from e
    except (ValueError, struct.error) as e:
        if "gguf_file" in kwargs:
            raise _unreadable_gguf(path_or_id, e) from e
        if type(e).__name__ != "HFValidationError":  # an id the hub client refuses, e.g. a missing path
            raise
        raise ValueError(f"{path_or_id}: not a model transformers can load ({e})") from e


def _unreadable_gguf(path_or_id, error: Exception) -> ValueError:
    """A cut GGUF file (struct's or numpy's words, which name no file) or an architecture transformers
    cannot read, named."""
    return ValueError(f"{path_or_id}: transformers cannot read this GGUF file ({error})")


def target_record(path_or_id: str | Path, model: PreTrainedModel) -> dict:
    """What a drafter checkpoint records of the target it was trained against (`flashdraft_target`): the
    name or path it was given as, and the class that loaded it (a GGUF file's config names none)."""
    return {"name_or_path": str(path_or_id), "architectures": [type(model).__name__]}
