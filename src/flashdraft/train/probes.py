"""What the trainer measures besides its steps: the training metrics on held-out conversations
(`validate`) and greedy speculative decoding on held-out prompts (`measure_tau`), at the steps the
config names. Both read the trainer's parts and change nothing in them."""

from __future__ import annotations

import contextlib
import time

import torch

from flashdraft.model.checkpoint import drafter_from_state
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.train.blocks import walk_lengths
from flashdraft.train.compile import recompiles_are_errors
from flashdraft.train.metrics import StepStats
from flashdraft.train.step import acceptance_map, target_features


def validate(trainer) -> dict:
    """The training metrics on held-out conversations, with `val_` names, and the served tau read
    off them: the first `val_batches` micro-batches of val_data, split over the drafter ranks, with
    a block at every anchor candidate (in passes of num_anchors per row).

    tau_train over all anchors counts easy and hard spots alike; decoding revisits the hard ones, so
    `val_tau_walk` walks each answer from its first token as decoding would (`walk_lengths`): the
    figure to set against the served tau. The forward runs with gradients enabled (and no
    backward) so that compiled layers reuse the training graph: no_grad would compile another,
    and a recompile here is an error, as in the training steps."""
    t0 = time.perf_counter()
    cfg, loader = trainer.cfg, trainer.val_loader
    stats = StepStats.zeros(trainer.drafter.block_size, trainer.device)
    stats.weight_sum = torch.zeros((), device=trainer.device)
    walks: list[list[int]] = []

    def add(mb, out) -> None:
        stats.add(out, mb)
        stats.weight_sum += mb.blocks.weights.sum()

    count = min(cfg.val_batches, loader.batches_in_epoch(0))
    guard = recompiles_are_errors() if trainer.compile_report is not None else contextlib.nullcontext()
    with guard:
        for k in range(trainer.topo.drafter_rank, count, trainer.topo.num_drafters):
            cpu = loader.batch(0, k)
            batch = cpu.to(trainer.device)
            feats = target_features(trainer.target, batch, cpu.plain_causal)
            with trainer._autocast():
                accepted = acceptance_map(
                    trainer.drafter, trainer.target, batch, feats, cfg.num_anchors, trainer.spec.gamma,
                    trainer.spec.kernels, on_pass=add,
                )  # fmt: skip
            walks += walk_lengths(accepted, cpu.loss_mask, cpu.doc_ids)
    trainer._reduce_stats(stats)
    stats.weight_sum = trainer.topo.drafter_sum_(stats.weight_sum).clamp(min=1e-6)
    taus = torch.tensor([sum(sum(w) / len(w) for w in walks), len(walks)], device=trainer.device)
    tau_sum, docs = trainer.topo.drafter_sum_(taus).tolist()
    m = {f"val_{k}": v for k, v in stats.to_metrics().items()}
    return m | {
        "val_tau_walk": tau_sum / max(docs, 1),
        "val_docs": int(docs),
        "val_s": time.perf_counter() - t0,
    }


def measure_tau(trainer) -> dict:
    """Greedy speculative decoding against the running target on held-out prompts: the serving
    acceptance length, watched during training instead of guessed from training accuracy.

    Decoding changes shapes every cycle, so the drafter's compiled layers run eagerly here
    (force_eager), outside the fail_on_recompile stance of training steps."""
    from flashdraft.eval.spec import eval_tau

    tokenizer, prompts = trainer.tau_probe
    t0 = time.perf_counter()
    new_tokens = trainer.cfg.eval_max_new_tokens
    if trainer.cfg.eval_cuda_graphs:  # graphs need weights that stay put: a copy, as a served export
        drafter = served_copy(trainer)
        with torch.compiler.set_stance("force_eager"):
            tau = eval_tau(trainer.target, tokenizer, drafter, prompts, new_tokens, cuda_graphs=True)
    else:
        with trainer._autocast(), torch.compiler.set_stance("force_eager"):
            tau = eval_tau(trainer.target, tokenizer, trainer.drafter, prompts, new_tokens)
    return {"tau": tau, "tau_eval_s": time.perf_counter() - t0}


def served_copy(trainer) -> DFlashDrafter:
    """An uncompiled eval-mode copy of the drafter as `flashdraft eval` loads its export: weights
    rounded through the target's dtype (bf16 on a GPU)."""
    dtype = next(trainer.target.model.parameters()).dtype
    return drafter_from_state(
        trainer.drafter.config, trainer.drafter.state_dict(), trainer.device, dtype
    ).eval()
