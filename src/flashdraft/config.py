"""Typed, validated run configuration with named presets.

`TrainConfig` is the recipe (drafter shape, data shape, optimizer, schedule, probes); `RunConfig` adds
`run:` (`RunSpec`: target, data, output, device, layout, backend, mirror): everything `flashdraft train`
needs, validated completely before anything is loaded. A run's config is a preset (`tiny_cpu`,
`qwen3_8b_h200`, ...) overlaid with a YAML file and then command-line options; the resolved result is
saved as RUN/config.yaml (with a `record:` of the target and data it trained on, which reading ignores)
and inside checkpoints, and `flashdraft train --config RUN/config.yaml` runs it again.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flashdraft.distributed.layout import Layout, TargetParallel

# DrafterSpec's fields that only a DFlash2 drafter has
DFLASH2_FIELDS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
)

FLOAT32_MAX = 3.4028234663852886e38  # the optimizer's state and the weights are float32


class _Strict(BaseModel):
    """Unknown fields, infinities and NaNs are refused; so is a number a float32 cannot hold (an
    `optim.lr` of 1e39 would make every weight infinite at the first step)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="after")
    def _fits_float32(self):
        for name, value in self:
            for x in value if isinstance(value, tuple) else (value,):
                if isinstance(x, float) and abs(x) > FLOAT32_MAX:
                    raise ValueError(f"{name}: {x} is beyond what a float32 holds")
        return self


class DrafterSpec(_Strict):
    """Shape of the drafter: its width is the target's; heads, head size, MLP width and RoPE follow the
    target's unless set here."""

    num_layers: int = Field(5, ge=1, description="draft decoder layers")
    num_taps: int = Field(5, ge=1, description="target layers tapped, spread by the default rule")
    target_layer_ids: list[int] | None = Field(None, description="explicit 0-based target layers")
    block_size: int = Field(16, ge=2, description="tokens drafted per block (B)")
    mask_token_id: int | None = Field(None, description="token id of MASK; auto-detected when unset")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width; the target's when unset")
    num_attention_heads: int | None = Field(None, ge=1, description="query heads; the target's when unset")
    num_key_value_heads: int | None = Field(
        None, ge=1, description="key/value heads; the target's when unset"
    )
    head_dim: int | None = Field(None, ge=1, description="size of a head; the target's when unset")
    rope_theta: float | None = Field(
        None, gt=0, description="RoPE base; the target's when unset (required for a target without RoPE)"
    )
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = Field(
        None, description="per drafter layer; default every layer full_attention"
    )
    sliding_window: int | None = Field(
        None, ge=2, description="keys a sliding_attention layer's query sees (itself included)"
    )
    architecture: Literal["dflash", "dflash2"] = Field(
        "dflash",
        description="dflash, or dflash2: a convolution along the block around each sublayer, a candidate "
        "selector that drafts a coherent path, and a multiplier and cap on the logits (docs/dflash.md)",
    )
    conv_kernel_size: int = Field(2, ge=1, description="dflash2: positions each convolution reads")
    conv_group_size: int = Field(
        64, ge=1, description="dflash2: channels sharing one dynamic kernel; divides the target's width"
    )
    selector_rank: int = Field(256, ge=1, description="dflash2: rank of the selector's pairwise scores")
    selector_top_k: int = Field(16, ge=1, description="dflash2: candidates per draft position")
    output_multiplier: float = Field(1.0, gt=0, description="dflash2: scale of the lm_head logits")
    final_logit_softcapping: float | None = Field(
        None, ge=0, description="dflash2: cap c of the logits, c * tanh(logits / c); unset or 0: none"
    )

    @model_validator(mode="after")
    def _dflash2(self) -> DrafterSpec:
        if self.architecture == "dflash":
            changed = [k for k in DFLASH2_FIELDS if getattr(self, k) != DrafterSpec.model_fields[k].default]
            if changed:
                raise ValueError(
                    f"drafter.{changed[0]} is a DFlash2 setting: set drafter.architecture to dflash2 (or "
                    "leave it at its default)"
                )
        elif "sliding_attention" in (self.layer_types or []):
            raise ValueError(
                "drafter.layer_types: a dflash2 drafter has no sliding_attention layers yet (its config's "
                "is_causal false makes the reference's windows two-sided, ours are causal)"
            )
        return self

    @model_validator(mode="after")
    def _layers(self) -> DrafterSpec:
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"drafter.layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        sliding = "sliding_attention" in (self.layer_types or [])
        if sliding and self.sliding_window is None:
            raise ValueError("drafter.layer_types has sliding_attention layers: set drafter.sliding_window")
        if self.sliding_window is not None and not sliding:
            raise ValueError(
                "drafter.sliding_window is set, but no drafter.layer_types entry is sliding_attention"
            )
        return self


# selector.alpha of a dflash2 drafter when the config leaves it unset
DFLASH2_SELECTOR_ALPHA = 0.5


class SelectorLossSpec(_Strict):
    """How a DFlash2 drafter's candidate selector trains (docs/dflash.md, DFlash2): beside the base loss
    on the logits, a cross-entropy over each draft position's top-k candidates scored as the selector
    scores them, with the true previous token as predecessor and the label as the class."""

    alpha: float | None = Field(
        None,
        ge=0,
        description=f"weight of the selector's term in the loss; unset: {DFLASH2_SELECTOR_ALPHA} for a "
        "dflash2 drafter (a dflash drafter has no selector: only 0)",
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps at the start with the term's weight 0")
    ramp_steps: int = Field(
        0, ge=0, description="optimizer steps after warmup_steps in which the weight rises linearly to alpha"
    )
    gold: Literal["inject", "skip"] = Field(
        "skip",
        description="a position whose label is not among the top-k: skip, the position has no selector "
        "loss; inject, the label replaces the lowest candidate in the loss (not in decoding). skip served "
        "3-7% more tau than inject at equal training tokens (docs/results.md, DFlash2)",
    )
    stop_gradient: bool = Field(
        True,
        description="the term trains the selector's parameters only: the logits and the drafter's hidden "
        "states it reads are detached, so the rest of the drafter learns from the base loss alone",
    )


class DataSpec(_Strict):
    seq_len: int = Field(3072, ge=16, description="tokens per packed row (fixed shape)")
    rows_per_batch: int = Field(1, ge=1, description="packed rows per micro-batch")
    pad_token_id: int | None = None
    one_document_per_row: bool = Field(
        False,
        description="one document per row even where the target keeps packed documents apart (a target "
        "whose layers carry state across documents always gets one per row)",
    )


class OptimSpec(_Strict):
    lr: float = Field(6e-4, gt=0)
    warmup_ratio: float = Field(0.04, ge=0, le=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)


class TrainConfig(_Strict):
    drafter: DrafterSpec = DrafterSpec()
    data: DataSpec = DataSpec()
    optim: OptimSpec = OptimSpec()
    num_anchors: int = Field(512, ge=1, description="anchors sampled per row")
    anchors_per_document: int | None = Field(None, ge=1, description="cap of anchors in one packed document")
    gamma: float | None = Field(None, gt=0, description="slot weight decay; by block size when unset")
    position_weights: Literal["gamma", "dpace"] = Field(
        "dpace",
        description="how a block's slots are weighted: dpace, each slot by its share of the gradient of "
        "the expected acceptance length, from the drafter's current probabilities of the labels (D-PACE, "
        "arXiv 2605.18810; the default: +10-12% served tau at T = 0 on SmolLM2, docs/recipe.md); gamma, "
        "the DFlash paper's fixed decay exp(-(k - 1) / gamma)",
    )
    dpace_alpha: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="with position_weights dpace: each slot's probability enters the expected acceptance "
        "length as (1 - alpha) p + alpha; 0, the exact expectation, trains nothing from a random start",
    )
    distill: float = Field(
        0.0,
        ge=0,
        le=1,
        description="soft-label distillation: each label's loss is (1 - distill) x CE + distill x KL from "
        "the target's next-token distribution there (its final hidden state and lm_head at label positions "
        "only; every target layer runs); 0: hard-label CE",
    )
    selector: SelectorLossSpec = SelectorLossSpec()
    init_from: str | None = Field(
        None,
        description="start from the z-lab drafter in this directory (ours or a released one): its shape "
        "and weights; drafter settings given here must match it",
    )
    epochs: int = Field(6, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    grad_accum: int = Field(1, ge=1)
    log_every: int = Field(10, ge=1)
    save_every: int | None = Field(None, ge=1)
    early_save: bool = Field(
        True,
        description="the first checkpoint of each `flashdraft train` process comes once the steps after its "
        "first have taken as long as its start-up (up to the end of that first step, compilation "
        "included), unless save_every saved sooner: a process killed after that loses at most the "
        "training since then, however far apart save_every's checkpoints are (docs/runs.md)",
    )
    recompute_logits: bool = Field(
        False,
        description="recompute lm_head logits in the backward instead of keeping them (qwen3-8b on the "
        "H200: 20 ms slower per step, no lower peak memory; docs/results.md)",
    )
    eval_every: int | None = Field(None, ge=1, description="measure tau (greedy spec decoding) every N steps")
    eval_prompts: str | None = Field(None, description="JSONL of held-out prompts for tau during training")
    eval_num_prompts: int = Field(8, ge=1)
    eval_max_new_tokens: int = Field(64, ge=1)
    eval_cuda_graphs: bool = Field(
        False,
        description="tau during training on fixed-shape caches replayed as CUDA graphs, decoding a copy "
        "of the drafter in the target's dtype (as a served export): faster probes on a GPU",
    )
    val_data: str | None = Field(
        None,
        description="a token dataset of held-out conversations (from `flashdraft data prepare`): loss, "
        "accuracy and tau_train on it every val_every steps and at the last, beside the training batches'",
    )
    val_every: int | None = Field(None, ge=1, description="measure on val_data every N steps")
    val_batches: int = Field(4, ge=1, description="micro-batches of val_data measured (its first ones)")
    max_bad_steps: int = Field(5, ge=1, description="stop after this many consecutive non-finite steps")
    wandb: bool = Field(False, description="also log to Weights & Biases (offline unless WANDB_MODE is set)")
    keep_last: int | None = Field(None, ge=1, description="keep only the newest K checkpoints")
    s3_wait_s: float = Field(
        600.0,
        gt=0,
        description="the longest wait at the end of a run for the S3 mirror to finish; a mirror not "
        "complete by then (or with an upload given up) ends the run with an error naming what is missing",
    )
    seed: int = 0
    fsdp: bool = Field(
        False,
        description="shard the drafter's parameters, gradients and optimizer state over the drafter ranks "
        "with FSDP2 fully_shard, for drafters too big to replicate; default: DDP replicas",
    )
    bf16_weights: bool | None = Field(
        None,
        description="the drafter's linears compute from bf16 copies of their fp32 weights, refreshed after "
        "each optimizer step, and their weight gradients are written in fp32 by the matmul: no casts of "
        "the weights or their gradients in a step, 2 bytes a parameter more memory "
        "(flashdraft.train.precision). Only where the drafter computes in bf16 (a GPU), not with fsdp; "
        "default: on there, off elsewhere",
    )
    compile: bool | None = Field(None, description="torch.compile flex_attention; default: on GPU")
    trust_compile_cache: bool = Field(
        False,
        description="on resume, load the compile-cache artifacts saved with the checkpoint: they are "
        "pickles, which run code when loaded, so only for a run you trust; default: compile again (the "
        "local persistent inductor cache still applies)",
    )
    compile_target: bool | None = Field(
        None,
        description="also torch.compile the target's decoder layers; default: with compile (qwen3-8b on "
        "the H200: target forward 96 -> 70 ms); true without compile is refused",
    )
    target_fp8: bool = Field(
        False,
        description="the frozen target's decoder-layer linears in FP8 (e4m3, a scale per weight row and per "
        "token; torch._scaled_mm): the features a drafter trains on come from them. Measured on SmolLM2: "
        "0.3-0.4% less served tau at T = 0, 1-2.5% at T = 1 (docs/recipe.md)",
    )
    target_attention: str = Field(
        "auto",
        pattern="^(auto|sdpa|eager|flex_attention|varlen|flash_attention_2|flash_attention_3)$",
        description="the target's transformers attention implementation; auto: the model's own choice "
        "(sdpa where supported, else eager), and on a GPU with packed rows the fastest of it, sdpa, "
        "flex_attention and varlen (torch's variable-length flash kernel) on the first batch's target "
        "forward (measured at start-up, remembered per machine and shape). The start-up line names it",
    )
    target_experts: str = Field(
        "auto",
        pattern="^(auto|eager|batched_mm|grouped_mm|gather_sum)$",
        description="a mixture-of-experts target's transformers experts implementation; auto: gather_sum "
        "where the model's own is grouped_mm (the same GEMMs, each token's expert outputs summed as one "
        "pointwise pass: flashdraft.model.experts), else the model's own. Any other name is refused for "
        "a target without routed experts",
    )
    attention: str = Field(
        "auto",
        pattern="^(auto|flex|dense)$",
        description="flex (GPU) or the dense SDPA reference (CPU: flex has no CPU backward); auto by device",
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.drafter.target_layer_ids is not None and not self.drafter.target_layer_ids:
            raise ValueError("drafter.target_layer_ids is empty")
        if self.drafter.architecture == "dflash" and self.init_from is None:  # init_from may make it dflash2
            defaults = SelectorLossSpec.model_fields
            changed = [k for k, v in self.selector if v != defaults[k].default and (k, v) != ("alpha", 0)]
            if changed:
                raise ValueError(
                    f"selector.{changed[0]} trains a DFlash2 drafter's candidate selector, which a dflash "
                    "drafter has not: set drafter.architecture to dflash2 (or leave it at its default)"
                )
        if self.data.seq_len < self.drafter.block_size:
            raise ValueError("data.seq_len must be at least drafter.block_size")
        if self.eval_every and not self.eval_prompts:
            raise ValueError("eval_every needs eval_prompts (a JSONL of held-out prompts)")
        if self.val_every and not self.val_data:
            raise ValueError("val_every needs val_data (a token dataset of held-out conversations)")
        if self.val_every and self.fsdp:
            raise ValueError(
                "val_every cannot be combined with fsdp: validation runs the unwrapped drafter; drop "
                "val_every and measure checkpoints instead"
            )
        if self.bf16_weights and self.fsdp:
            raise ValueError(
                "bf16_weights cannot be combined with fsdp: FSDP2 gathers each layer's weights in its own "
                "dtype for the forward; drop one of them"
            )
        if self.eval_every and self.fsdp:
            raise ValueError(
                "eval_every cannot be combined with fsdp: tau is measured on the main rank alone, and a "
                "sharded drafter runs only on all drafter ranks together; drop eval_every and measure "
                "checkpoints with `flashdraft eval`, or train without fsdp"
            )
        return self


class RunSpec(_Strict):
    """What a run trains against, where it writes, how its processes are laid out: the part of a run
    that is not the recipe. `resume`, `overwrite` and `auto_resume` are what one invocation does with
    `out`; they are not saved."""

    target: str = Field(min_length=1, description="target model: local HF directory, hub id or .gguf file")
    data: str = Field(min_length=1, description="token dataset directory (from `flashdraft data prepare`)")
    out: str = Field(min_length=1, description="run directory")
    device: str | None = Field(None, pattern=r"^(cpu|cuda)(:\d+)?$", description="default: cuda when visible")
    layout: str = Field("colocated", description="colocated, or split:T:D (T target + D drafter ranks)")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process-group backend: auto (NCCL on GPU, gloo on CPU), gloo or nccl"
    )
    target_parallel: str = Field(
        "none", description="none, or fsdp:N: the frozen target sharded (FSDP2) over groups of N target ranks"
    )
    s3: str | None = Field(None, pattern=r"^s3://[^/]+", description="mirror to s3://bucket/prefix")
    resume: bool = Field(False, description="continue the run in `out` (or restore it from `s3`)")
    overwrite: bool = Field(False, description="`out` holds a run: delete it and start again")
    auto_resume: bool = Field(
        False,
        description="continue the run in `out` from its newest complete checkpoint (there, or in `s3`) when "
        "it has one, else start it, replacing what a run that never saved left there: one command that "
        "starts a preemptible run and continues it after any kill",
    )

    @field_validator("layout")
    @classmethod
    def _layout(cls, text: str) -> str:
        return str(Layout.parse(text))

    @field_validator("target_parallel")
    @classmethod
    def _target_parallel(cls, text: str) -> str:
        return str(TargetParallel.parse(text))

    @property
    def parsed_layout(self) -> Layout:
        return Layout.parse(self.layout)

    @model_validator(mode="after")
    def _one_action(self) -> RunSpec:
        if self.resume and self.overwrite:
            raise ValueError("resume continues the run in `out`, overwrite deletes it: choose one")
        if self.auto_resume and (self.resume or self.overwrite):
            other = "resume" if self.resume else "overwrite"
            raise ValueError(
                f"auto_resume decides itself whether to continue the run in `out` or start it: drop {other}"
            )
        return self


class RunConfig(TrainConfig):
    """The recipe and `run:`; see the module docstring."""

    run: RunSpec
    record: dict[str, Any] | None = Field(
        None, description="what a run recorded of its target and data; written by flashdraft, ignored on read"
    )

    @field_validator("record")
    @classmethod
    def _ignored(cls, _) -> None:
        return None

    @model_validator(mode="after")
    def _fits_layout(self) -> RunConfig:
        if self.run.target_parallel != "none":
            if self.target_fp8:
                raise ValueError("target_fp8 is for a whole target: a sharded one stays in its dtype")
            for name in ("eval_every", "val_data"):
                if getattr(self, name):
                    raise ValueError(
                        f"{name} runs the target on the main rank alone, and a sharded target runs only on "
                        f"all the ranks of its group: drop {name} with target_parallel, and evaluate the "
                        "checkpoints with `flashdraft eval`"
                    )
        if self.run.parsed_layout.is_split:
            if self.eval_every:
                raise ValueError(
                    "eval_every needs the whole target on the drafter rank: use the colocated layout"
                )
            if self.val_data:
                raise ValueError("val_data needs the target on the drafter ranks: use the colocated layout")
            if self.distill:
                raise ValueError(
                    "distill needs the target's final hidden state on the drafter ranks: use the colocated "
                    "layout"
                )
        return self


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny_cpu": {
        "drafter": {"num_layers": 2, "num_taps": 2},
        "data": {"seq_len": 256, "rows_per_batch": 4},
        "num_anchors": 32,
        "optim": {"lr": 3e-3, "warmup_ratio": 0.05},
        "epochs": 4,
        "log_every": 10,
    },
    # fine-tuning a drafter given by init_from (its shape comes from there): a tenth of the default
    # learning rate, a short warm-up
    "finetune": {"optim": {"lr": 6e-5, "warmup_ratio": 0.01}},
    "qwen3_8b_h200": {
        "drafter": {"num_layers": 5, "num_taps": 5},
        # two rows a micro-batch: 70.3% MFU on one H200 against 66.3% at one (44.8 GiB; docs/results.md)
        "data": {"seq_len": 3072, "rows_per_batch": 2},
        "num_anchors": 512,
    },
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """tree["optim"]["lr"] = value for key "optim.lr", creating the mappings on the way."""
    *parents, leaf = key.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def resolve_config(preset: str = "default", yaml_path: Path | None = None, **overrides: Any) -> TrainConfig:
    """preset < YAML file < overrides (dotted keys such as `optim.lr`); None overrides are ignored. A
    saved RUN/config.yaml is read as its recipe (its `run:` and `record:` left out)."""
    raw = _resolve_raw(preset, yaml_path, overrides)
    raw.pop("run", None), raw.pop("record", None)
    return _validate(TrainConfig, raw, yaml_path)


def resolve_run_config(preset: str = "default", yaml_path: Path | None = None, **overrides: Any) -> RunConfig:
    """As resolve_config, with `run.*` keys (`run.target`, `run.out`, ...) among the overrides or a
    `run:` mapping in the YAML: the whole run, checked before anything loads."""
    return _validate(RunConfig, _resolve_raw(preset, yaml_path, overrides), yaml_path)


def run_config(cfg: TrainConfig, **run: Any) -> RunConfig:
    """A recipe and its `run:` settings (RunSpec's fields) as one RunConfig."""
    raw = cfg.model_dump(mode="json", exclude={"run", "record"}, exclude_unset=True)  # keeps what was set
    run = {k: str(v) if isinstance(v, Path) else v for k, v in run.items() if v is not None}
    return _validate(RunConfig, {**raw, "run": run}, None)


def _validate(model: type[BaseModel], raw: dict, yaml_path: Path | None):
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        where = f" in {yaml_path}" if yaml_path else ""
        raise ValueError(f"invalid config{where}:\n{e}") from None


class _StrictLoader(yaml.SafeLoader):
    """yaml's safe loader (no tags that build Python objects) that also refuses a key given twice in one
    mapping, which yaml would resolve silently to the last value."""


def _unique_keys(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    lines: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if isinstance(key, str | int | float | bool) and key in lines:
            raise yaml.constructor.ConstructorError(
                None, None, f"{key!r} is given twice (lines {lines[key]} and {line})", key_node.start_mark
            )
        lines[key] = line
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_keys)


def load_yaml(text: str) -> Any:
    """A config file's YAML: safe, and a key given twice in a mapping is an error (yaml.YAMLError)."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no tags that build Python objects


def _resolve_raw(preset: str, yaml_path: Path | None, overrides: dict) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    raw = copy.deepcopy(PRESETS[preset])  # the overrides below must not change the preset itself
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ValueError(f"{path}: no such config file" + (" (a directory)" if path.is_dir() else ""))
        try:
            loaded = load_yaml(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{yaml_path}: expected a mapping at the top level")
        raw = _merge(raw, loaded)
    for key, value in overrides.items():
        if value is not None:
            set_dotted(raw, key, value)
    return raw


def save_config(cfg: TrainConfig, path: Path, record: dict | None = None) -> None:
    """RUN/config.yaml: the config as `--config` reads it back (a run's `resume`, `overwrite` and
    `auto_resume` left out), then `record:`."""
    data = cfg.model_dump(
        mode="json", exclude={"record": True, "run": {"resume", "overwrite", "auto_resume"}}
    )
    if record:
        data["record"] = record
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
