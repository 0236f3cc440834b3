"""Building a run: read the world, load the target and the token dataset, build the drafter, and hand
them to a `Trainer` (train/trainer.py), which runs it. `build(config, source)` is shared by
`flashdraft train` and `flashdraft bench`; `RunSource` says what a run reads (a target directory and a
token dataset by default, random weights of a named shape for the bench).
"""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from flashdraft.config import RunConfig, RunSpec, TrainConfig, run_config
from flashdraft.data.packing import MicroBatchStream, PackedLoader, load_token_dataset
from flashdraft.distributed.topology import Topology, init_topology
from flashdraft.model.checkpoint import latest_checkpoint, load_drafter
from flashdraft.model.dflash2 import DFlash2Settings
from flashdraft.model.drafter import DFlashDrafter, check_dflash2, default_target_layer_ids, drafter_config
from flashdraft.model.experts import set_target_experts
from flashdraft.model.target import (
    Target,
    choose_packing,
    decoder_layers,
    embedding_scale,
    load_target,
    target_config,
    target_record,
)
from flashdraft.run.provenance import check_data_fits_target, check_resume_record, run_record
from flashdraft.train.compile import start_compile_workers
from flashdraft.train.mask import FIELD as MASK_FIELD
from flashdraft.train.mask import choose_mask_token, count_tokens
from flashdraft.train.trainer import Trainer, compiles


@dataclass(frozen=True)
class Batches:
    """A run's training batches (a MicroBatchStream's interface), its held-out ones, and what the
    run records of its target and data (checked on resume)."""

    stream: Any
    val: PackedLoader | None
    record: dict


@dataclass(frozen=True)
class RunSource:
    """What a run reads. `build` makes it from `run.target` and `run.data` (`path_source`);
    `flashdraft bench` gives random weights of a named shape and synthetic batches.

    target_config: the whole target's. load_target(layers, device, attention): (model, tokenizer)
    holding the first `layers` decoder layers (None: all). batches(cfg, model, tokenizer, packing): the
    Batches. target_record(model): what a checkpoint records of the target. load_sharded(layers, topo,
    attention): as load_target, the layers sharded over the rank's target group (None: not offered).
    token_counts(ids): how often each id occurs in the training data, which a MASK token chosen from the
    tokenizer's special tokens must not hold (train/mask.py; None: the source cannot say)."""

    target_config: Any
    load_target: Callable[[int | None, torch.device, str], tuple]
    batches: Callable[[TrainConfig, Any, Any, str], Batches]
    target_record: Callable[[Any], dict]
    load_sharded: Callable[[int | None, Topology, str], tuple] | None = None
    token_counts: Callable[[Sequence[int]], Sequence[int]] | None = None


def path_source(target_path: str, data_dir: str) -> RunSource:
    """The target from a directory, hub id or .gguf file; the token dataset from `data prepare`."""

    def load(layers, device, attention):
        return load_target(target_path, device, attention=attention, layers=layers)

    def load_sharded(layers, topo, attention):
        from flashdraft.distributed.sharded_target import load_sharded_target

        return load_sharded_target(target_path, topo, attention=attention, layers=layers)

    def batches(cfg: TrainConfig, model, tokenizer, packing: str) -> Batches:
        pad = cfg.data.pad_token_id
        if pad is None:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        rows = (cfg.data.seq_len, cfg.data.rows_per_batch, pad, cfg.seed, packing == "one_document")
        dataset = load_token_dataset(data_dir)
        check_data_fits_target(data_dir, dataset, tokenizer, model.get_input_embeddings().num_embeddings)
        val = None
        if cfg.val_data:  # the config refuses it in a split layout
            val = PackedLoader(load_token_dataset(cfg.val_data), *rows)
            if val.batches_in_epoch(0) == 0:
                raise ValueError(
                    f"val_data {cfg.val_data}: too little for one micro-batch of "
                    f"{cfg.data.rows_per_batch} x {cfg.data.seq_len} tokens"
                )
        stream = MicroBatchStream(PackedLoader(dataset, *rows), cfg.epochs)
        return Batches(stream, val, run_record(target_path, model, data_dir, dataset))

    return RunSource(
        target_config(target_path),
        load,
        batches,
        lambda model: target_record(target_path, model),
        load_sharded,
        lambda ids: count_tokens(load_token_dataset(data_dir), ids),
    )


def build(config: RunConfig, source: RunSource | None = None) -> Trainer:
    """Read the world, load the target and the token dataset, build the drafter: a Trainer ready to run.

    With `run.s3`, checkpoints and logs are mirrored there; resuming with an empty `run.out` first
    restores the run's newest complete checkpoint from it (a fresh machine). A `run.out` holding a run
    is refused unless `run.resume` (continue it), `run.overwrite` (delete it and start again) or
    `run.auto_resume` (continue it when it has a checkpoint, else start it: `prepare_out`); a resume
    checks the target and data against the run's record (flashdraft.run.provenance). `source`: what the
    run reads, by default `path_source(run.target, run.data)`.
    """
    cfg, run = config, config.run
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb needs the wandb package: pip install 'flashdraft[wandb]'")
    topo = init_topology(run.parsed_layout, run.device, run.backend, run.target_parallel)
    if compiles(cfg, topo.device):
        start_compile_workers()  # they start while the target loads
    resume = prepare_out(run, topo)
    torch.manual_seed(cfg.seed)
    source = source or path_source(run.target, run.data)
    whole = source.target_config
    if cfg.init_from:  # checked against the target's config before the target loads
        cfg = with_init_from(cfg, whole)
    if cfg.drafter.architecture == "dflash2":
        text = whole.get_text_config()
        check_dflash2(dflash2_of(cfg), text.hidden_size, text.vocab_size, cfg.drafter.sliding_window)
    model, tokenizer = load_target_layers(cfg, source, topo, layers_to_load(cfg, topo, tap_ids(cfg, whole)))
    mask = choose_mask_token(
        tokenizer,
        model.get_input_embeddings().num_embeddings,
        cfg.drafter.mask_token_id,  # an init_from drafter's, when it has one
        source.token_counts,
        "the init_from drafter's" if cfg.init_from else MASK_FIELD,
    )
    drafter, target = drafter_and_target(cfg, model, mask.id, topo, whole)
    if cfg.target_fp8:  # after the packing probe, which differentiates through the target
        from flashdraft.model.fp8 import to_fp8_

        replaced, kept = to_fp8_(decoder_layers(model)[2])
        if topo.rank == 0:
            print(f"target in FP8: {replaced} linears e4m3 (row-wise scales), {kept} kept", flush=True)
    drafter.config.flashdraft_target = source.target_record(model)  # written with every checkpoint
    batches = source.batches(cfg, model, tokenizer, target.packing)
    del model  # the Target holds it
    measure_target_attention(cfg, target, batches.stream, topo)
    out = Path(run.out)
    if resume and (out / "config.yaml").is_file():
        saved = yaml.safe_load((out / "config.yaml").read_text()) or {}
        check_resume_record(saved.get("record") or saved, batches.record, out)  # top level: older runs
    steps = total_steps(cfg, batches.stream, topo, run.data)
    probe = tau_probe(cfg, tokenizer, topo)
    mirror = None
    if run.s3 and topo.is_main:
        from flashdraft.run.s3 import S3Mirror

        mirror = S3Mirror(run.s3)
    return Trainer(
        cfg, target, drafter, batches.stream, steps, topo, out, batches.record, resume,
        val_loader=batches.val, tau_probe=probe, mirror=mirror, mask=mask,
    )  # fmt: skip


def measure_target_attention(
    cfg: TrainConfig, target: Target, stream, topo: Topology, devices: tuple[str, ...] = ("cuda",)
) -> None:
    """`train.target_attention: auto` on a GPU with packed rows: the target's attention measured on the
    first micro-batch (flashdraft.train.target_attention), the main rank's choice taken by every target
    rank. Elsewhere (a CPU, one document a row, a sharded target) the model's own stays."""
    if cfg.target_attention != "auto" or topo.device.type not in devices or topo.target_group is not None:
        return
    if target.packing != "positions":
        return
    batch = stream[0]
    choice = None
    if topo.is_target and not batch.plain_causal:
        from flashdraft.train.compile import use_cache_dir
        from flashdraft.train.target_attention import choose_target_attention

        device = topo.device
        cache = use_cache_dir(None, device)
        ids, positions = batch.input_ids.to(device), batch.position_ids.to(device)
        choice = choose_target_attention(target, ids, positions, cache)
    main = topo.gather_objects(choice.name if choice else None)[0]
    if main is not None and topo.is_target:
        target.model.set_attn_implementation(main)
    if choice is not None and topo.is_main:
        print(choice.line(), flush=True)


def build_trainer(
    cfg: TrainConfig,
    target_path: str,
    data_dir: str,
    out_dir: str,
    device: str | None = None,
    layout: str = "colocated",
    resume: bool = False,
    s3_url: str | None = None,
    backend: str = "auto",
    overwrite: bool = False,
    auto_resume: bool = False,
) -> Trainer:
    """`build` of a TrainConfig and its run settings given one by one."""
    run = {"target": target_path, "data": data_dir, "out": out_dir, "device": device, "layout": layout}
    run |= {"resume": resume, "s3": s3_url, "backend": backend, "overwrite": overwrite}
    run |= {"auto_resume": auto_resume}
    return build(run_config(cfg, **run))


def prepare_out(run: RunSpec, topo: Topology) -> bool:
    """`run.out` ready for the run; returns whether the run continues from a checkpoint. One holding a
    run is refused unless resumed or overwritten (then deleted); a resume with no checkpoint there
    restores the newest one from `run.s3`. `run.auto_resume` decides between the two (`auto_resume`)."""
    if run.auto_resume:
        return auto_resume(run, topo)
    out = Path(run.out)
    existing = [n for n in ("config.yaml", "checkpoints") if (out / n).exists()]
    if existing and not run.resume:
        if not run.overwrite:
            raise ValueError(
                f"{out} holds a run ({', '.join(existing)}): --resume {out} continues it, --overwrite "
                "deletes it and starts again, or choose another --out"
            )
        if topo.is_main:
            shutil.rmtree(out)
        topo.barrier()
    if run.resume and run.s3 and topo.is_main and latest_checkpoint(out / "checkpoints") is None:
        from flashdraft.run.s3 import restore_run

        restore_run(run.s3, out)
    topo.barrier()
    return run.resume


# What a run writes in its directory (train/trainer.py, train/metrics.py) and, in RUN/checkpoints, the
# names a save gives its directories and files (model/checkpoint.py): all `auto_resume` ever deletes.
RUN_ENTRIES = ("config.yaml", "env.json", "train.log", "metrics.jsonl", "result.json", "tb", "wandb")
CHECKPOINT_ENTRY = re.compile(r"(\.tmp-|\.replaced-)?step_\d+|\.LATEST\.tmp")


def auto_resume(run: RunSpec, topo: Topology) -> bool:
    """`run.auto_resume`: whether the run continues, decided on the main rank and followed by every
    rank (which then agree however their views of the directory differ). It continues from the newest
    complete checkpoint in `run.out`, else from one restored from `run.s3`; with neither it starts, after
    removing what a run that never saved left in `run.out` (`clear_unsaved_run`), and says so."""
    decision = None
    if topo.is_main:
        try:
            decision = (_continue_or_start(run), None)
        except (ValueError, OSError) as e:  # every rank raises it, none waits for the main rank
            decision = (False, str(e))
    resume, error = next(d for d in topo.gather_objects(decision) if d is not None)
    if error is not None:
        raise ValueError(error)
    return resume


def _continue_or_start(run: RunSpec) -> bool:
    out = Path(run.out)
    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is not None:
        print(f"auto-resume: continuing {out} from {ckpt}", flush=True)
        return True
    removed = clear_unsaved_run(out) if out.exists() else []
    if run.s3:
        from flashdraft.run.s3 import restore_run

        ckpt = restore_run(run.s3, out)
        if ckpt is not None:
            print(f"auto-resume: continuing {out} from {ckpt}, restored from {run.s3}", flush=True)
            return True
    where = f"{out} or {run.s3}" if run.s3 else str(out)
    if removed:
        print(
            f"auto-resume: no complete checkpoint in {where} (the run stopped before its first save): "
            f"removed what it wrote ({', '.join(removed)}) and starting it again",
            flush=True,
        )
    else:
        print(f"auto-resume: no checkpoint in {where}: starting the run", flush=True)
    return False


def clear_unsaved_run(out: Path) -> list[str]:
    """Delete what a run that never completed a checkpoint wrote in `out` (RUN_ENTRIES, RUN/checkpoints'
    partial saves) and return their names; `out` itself stays (it may be a mount point). Anything else
    there is refused, named, and nothing is deleted: `out` is then not (only) a run's. config.yaml
    stays: the run rewrites it as it starts, and it may be the --config of the very command that
    restarts it."""
    if not out.is_dir():
        raise ValueError(f"--out {out} is not a directory")
    entries = sorted(p.name for p in out.iterdir())
    ckpts = out / "checkpoints"
    held = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    foreign = [
        n
        for n in entries
        if n not in (*RUN_ENTRIES, "checkpoints") or (n == "checkpoints" and not ckpts.is_dir())
    ]
    foreign += [f"checkpoints/{n}" for n in held if not CHECKPOINT_ENTRY.fullmatch(n)]
    if foreign:
        raise ValueError(
            f"{out} holds no complete checkpoint to continue, and files that no run writes "
            f"({', '.join(foreign)}): nothing was deleted; choose another --out, or move them away"
        )
    removed = []
    for name in entries:
        if name == "config.yaml":
            continue
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(name)
    return removed


def load_target_layers(cfg: TrainConfig, source: RunSource, topo: Topology, layers: int | None) -> tuple:
    """(model, tokenizer): the target's first `layers` decoder layers on this rank, sharded over its
    target group when the run's target is parallel."""
    if topo.target_group is not None:
        check_sharded_fits(cfg, topo)
        if source.load_sharded is None:
            raise ValueError("this run's target cannot be sharded (it is not read from a directory)")
        model, tokenizer = source.load_sharded(layers, topo, cfg.target_attention)
        set_target_experts(model, cfg.target_experts)
        if topo.rank == 0:
            from flashdraft.distributed.sharded_target import sharding_line

            print(sharding_line(model, topo), flush=True)
        return model, tokenizer
    model, tokenizer = source.load_target(layers, topo.device, cfg.target_attention)
    set_target_experts(model, cfg.target_experts)
    if cfg.target_fp8:
        from flashdraft.model.fp8 import check_fp8_device

        check_fp8_device(topo.device)
    return model, tokenizer


def check_sharded_fits(cfg: TrainConfig, topo: Topology) -> None:
    """The ranks of a target group run one forward together per micro-batch, so in a split layout each
    target rank must serve as many micro-batches a step as the others."""
    lay = topo.layout
    if lay.is_split and cfg.grad_accum * lay.drafters % lay.targets:
        raise ValueError(
            f"target parallelism {topo.target_parallel} in layout {lay}: a step's "
            f"{cfg.grad_accum * lay.drafters} micro-batches (grad_accum x {lay.drafters} drafter ranks) do "
            f"not divide evenly over the {lay.targets} target ranks, whose groups must run the same number "
            "of forwards"
        )


def tap_ids(cfg: TrainConfig, target_config) -> list[int]:
    """The target layers the run's drafter reads (set, from init_from, or spread over the target)."""
    if cfg.drafter.target_layer_ids:
        return list(cfg.drafter.target_layer_ids)
    return default_target_layer_ids(target_config.get_text_config().num_hidden_layers, cfg.drafter.num_taps)


def layers_to_load(cfg: TrainConfig, topo: Topology, taps: list[int]) -> int | None:
    """How many of the target's decoder layers this rank runs (`load_target(layers=...)`): none on a
    drafter rank of a split layout (the embedding and lm_head are all it uses), every one for
    distillation (the final hidden state) and for tau during training (decoding), else up to the last
    tap."""
    if not topo.is_target:
        return 0
    if cfg.distill or cfg.eval_every:
        return None
    return max(taps) + 1


def with_init_from(cfg: TrainConfig, target_config) -> TrainConfig:
    """`cfg` with the drafter shape of its init_from directory (a z-lab drafter, validated as an export
    is), checked against the target; a drafter setting given in the config that differs is an error."""
    from flashdraft.export.formats import block_size_of, read_zlab

    source = Path(cfg.init_from)
    raw, _ = read_zlab(source)
    t = target_config.get_text_config()
    ids = list(raw["dflash_config"]["target_layer_ids"])
    fits = {
        "hidden_size": (raw["hidden_size"], t.hidden_size),
        "vocab_size": (raw["vocab_size"], t.vocab_size),
        "num_target_layers": (raw["num_target_layers"], t.num_hidden_layers),
    }
    problems = [
        f"{k} {ours} (the target's: {theirs})" for k, (ours, theirs) in fits.items() if ours != theirs
    ]
    if problems:
        raise ValueError(f"init_from {source}: a drafter for another target: " + "; ".join(problems))
    shape = {
        "num_layers": raw["num_hidden_layers"],
        "target_layer_ids": ids,
        "num_taps": len(ids),
        "block_size": block_size_of(raw),
        "mask_token_id": raw["dflash_config"]["mask_token_id"],
        "intermediate_size": raw["intermediate_size"],
        "num_attention_heads": raw["num_attention_heads"],
        "num_key_value_heads": raw["num_key_value_heads"],
        "head_dim": raw["head_dim"],
        "layer_types": list(raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]),
        "sliding_window": raw.get("sliding_window") if raw.get("use_sliding_window") else None,
    }
    if raw["architectures"] == ["DFlash2DraftModel"]:  # a DFlash source may become a DFlash2 drafter
        settings = DFlash2Settings.from_dflash_config(raw["dflash_config"])
        shape |= {"architecture": "dflash2", **settings.as_dict()}
    given = cfg.drafter.model_fields_set
    conflicts = [
        f"drafter.{k}: {getattr(cfg.drafter, k)} here, {v} in {source}"
        for k, v in shape.items()
        if k in given and getattr(cfg.drafter, k) != v
    ]
    if conflicts:
        raise ValueError(
            f"init_from {source} fixes the drafter's shape; leave these unset or match them: "
            + "; ".join(conflicts)
        )
    return cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update=shape)})


def drafter_and_target(
    cfg: TrainConfig, model, mask_id: int, topo: Topology, target_config=None
) -> tuple[DFlashDrafter, Target]:
    """The run's drafter (initialised from the seed with MASK `mask_id`, or the init_from drafter) and the
    Target it reads, packed as the target needs (`choose_packing`, measured on a target rank and shared
    with the drafter ranks of a split layout): what `build` gives the Trainer. `target_config` is the
    whole target's when `model` holds only its first layers."""
    whole = target_config or model.config
    if cfg.init_from:
        drafter = load_drafter(cfg.init_from, topo.device)
        if cfg.drafter.architecture == "dflash2" and drafter.dflash2 is None:
            drafter = dflash2_from_dflash(drafter, dflash2_of(cfg), _init_std(model), cfg.seed)
    else:
        drafter = build_drafter(cfg, model, mask_id, topo.device, whole)
    asked = cfg.data.one_document_per_row
    ids = drafter.target_layer_ids
    packing = "one_document" if asked else choose_packing(model, ids) if topo.is_target else None
    if topo.distributed:  # the drafter ranks of a split layout hold no layers to probe
        packing = next(p for p in topo.gather_objects(packing) if p is not None)
    if packing == "one_document" and not asked and topo.is_main:
        print(
            "the target's layers carry state across packed documents (no mask keeps them apart): "
            "training rows hold one document each",
            flush=True,
        )
    return drafter, Target(model, ids, packing, config=whole)


def build_drafter(cfg: TrainConfig, model, mask_id: int, device, target_config=None) -> DFlashDrafter:
    """A drafter for `model` (`target_config`: the whole target's, when the model holds only its first
    layers) with MASK `mask_id` (`choose_mask_token`), initialised from the seed."""
    spec = cfg.drafter
    dcfg = drafter_config(
        target_config or model.config,
        num_layers=spec.num_layers,
        target_layer_ids=spec.target_layer_ids,
        num_taps=spec.num_taps,
        block_size=spec.block_size,
        mask_token_id=mask_id,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        rope_theta=spec.rope_theta,
        layer_types=spec.layer_types,
        sliding_window=spec.sliding_window,
        dflash2=dflash2_of(cfg),
    )
    scale = embedding_scale(model.get_input_embeddings())
    if scale != 1.0:  # a Gemma target's: recorded for the engines and the reference (checkpoint.zlab_config)
        dcfg.input_embedding_scale = scale
    drafter = DFlashDrafter(dcfg).to(device=device, dtype=torch.float32)
    init_drafter_(drafter, _init_std(model), seed=cfg.seed)
    return drafter


def _init_std(model) -> float:
    return getattr(model.config.get_text_config(), "initializer_range", None) or 0.02


def dflash2_of(cfg: TrainConfig) -> DFlash2Settings | None:
    """The run's DFlash2 settings (drafter.*); None for a DFlash drafter."""
    if cfg.drafter.architecture != "dflash2":
        return None
    return DFlash2Settings(**{k: getattr(cfg.drafter, k) for k in DFlash2Settings.__dataclass_fields__})


def dflash2_from_dflash(
    drafter: DFlashDrafter, settings: DFlash2Settings, std: float, seed: int
) -> DFlashDrafter:
    """A DFlash2 drafter that starts from a DFlash one (--init-from): the DFlash weights copied, the
    DFlash2 modules as `init_drafter_` leaves them, which drafts exactly as the DFlash drafter at T = 0."""
    config = copy.deepcopy(drafter.config)
    config.dflash2 = settings.as_dict()
    upgraded = DFlashDrafter(config)
    init_drafter_(upgraded, std, seed)
    upgraded.load_state_dict(upgraded.state_dict() | drafter.state_dict())  # strict: every DFlash weight
    return upgraded.to(drafter.fc.weight.device)


def init_drafter_(drafter: DFlashDrafter, std: float, seed: int) -> None:
    """Explicit init: normal(0, std) linears, ones for norms; seeded so runs are reproducible. DFlash2's
    modules then start as the identity and pairwise scores of 0 (`reset_dflash2_to_dflash_`): a DFlash
    drafter that its own modules change as they learn."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    if drafter.dflash2 is not None:
        drafter.reset_dflash2_to_dflash_()


def total_steps(cfg: TrainConfig, stream, topo: Topology, data: str) -> int:
    """The run's optimizer steps: `max_steps`, else the stream's epochs; too little data for one step
    is an error."""
    per_step = cfg.grad_accum * topo.num_drafters
    held = stream.upto(per_step)  # the whole length only when max_steps does not set it
    if held < per_step:
        raise ValueError(f"{data}: too little data for one step ({held} batches, {per_step} needed)")
    return cfg.max_steps or len(stream) // per_step


def tau_probe(cfg: TrainConfig, tokenizer, topo: Topology) -> tuple | None:
    """(tokenizer, prompts) for tau during training, on the main rank when `eval_every` is set."""
    if not (cfg.eval_every and topo.is_main):
        return None
    from flashdraft.eval.spec import read_prompts

    return tokenizer, read_prompts(cfg.eval_prompts, limit=cfg.eval_num_prompts)
