"""What a run measures besides its steps: the training metrics on held-out conversations (`validate`)
and greedy speculative decoding on held-out prompts (`measure_tau`), at the steps the config names.
Both read the run's drafter and target and change nothing in them."""

from __future__ import annotations

import contextlib
import time

import torch

from flashdraft.data.packing import PackedLoader
from flashdraft.distributed.topology import Topology
from flashdraft.model.checkpoint import drafter_from_state
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.target import Target
from flashdraft.train.blocks import walk_lengths
from flashdraft.train.compile import recompiles_are_errors
from flashdraft.train.metrics import StepStats
from flashdraft.train.step import StepSpec, acceptance_map, target_features


def autocast(device: torch.device):
    """The drafter's precision on `device`: bf16 autocast on a GPU, fp32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def sum_over_drafters_(stats: StepStats, topo: Topology) -> None:
    """Sum a step's loss and accuracy counts over the drafter ranks, in place."""
    for t in (stats.loss_sum, stats.correct, stats.counted, stats.accepted, stats.blocks, stats.selector):
        if t is not None:
            topo.drafter_sum_(t)


def validate(
    loader: PackedLoader,
    batches: int,
    drafter: DFlashDrafter,
    target: Target,
    spec: StepSpec,
    topo: Topology,
    warmed_up: bool,
) -> dict:
    """The training metrics on held-out conversations, with `val_` names, and the served tau read
    off them: the first `batches` micro-batches of `loader`, split over the drafter ranks, with
    a block at every anchor candidate (in passes of `spec.num_anchors` per row).

    tau_train over all anchors counts easy and hard spots alike; decoding revisits the hard ones, so
    `val_tau_walk` walks each answer from its first token as decoding would (`walk_lengths`): the
    figure to set against the served tau. The forward runs with gradients enabled (and no
    backward) so that compiled layers reuse the training graph: no_grad would compile another,
    and once the compiled run is `warmed_up` a recompile here is an error, as in the training steps."""
    t0 = time.perf_counter()
    device = topo.device
    stats = StepStats.zeros(drafter.block_size, device)
    stats.weight_sum = torch.zeros((), device=device)
    walks: list[list[int]] = []

    def add(mb, out) -> None:
        stats.add(out, mb)
        stats.weight_sum += mb.blocks.weights.sum()

    count = min(batches, loader.batches_in_epoch(0))
    guard = recompiles_are_errors() if warmed_up else contextlib.nullcontext()
    with guard:
        for k in range(topo.drafter_rank, count, topo.num_drafters):
            cpu = loader.batch(0, k)
            batch = cpu.to(device)
            feats = target_features(target, batch, cpu.plain_causal)
            with autocast(device):
                accepted = acceptance_map(
                    drafter, target, batch, feats, spec.num_anchors, spec.gamma, spec.kernels, on_pass=add
                )
            walks += walk_lengths(accepted, cpu.loss_mask, cpu.doc_ids)
    sum_over_drafters_(stats, topo)
    stats.weight_sum = topo.drafter_sum_(stats.weight_sum).clamp(min=1e-6)
    taus = torch.tensor([sum(sum(w) / len(w) for w in walks), len(walks)], device=device)
    tau_sum, docs = topo.drafter_sum_(taus).tolist()
    m = {f"val_{k}": v for k, v in stats.to_metrics().items()}
    return m | {
        "val_tau_walk": tau_sum / max(docs, 1),
        "val_docs": int(docs),
        "val_s": time.perf_counter() - t0,
    }


def measure_tau(
    tokenizer,
    prompts: list,
    drafter: DFlashDrafter,
    target: Target,
    device: torch.device,
    max_new_tokens: int,
    cuda_graphs: bool,
) -> dict:
    """Greedy speculative decoding against the running target on held-out prompts: the serving
    acceptance length, watched during training instead of guessed from training accuracy.

    Decoding changes shapes every cycle, so the drafter's compiled layers run eagerly here
    (force_eager), outside the fail_on_recompile stance of training steps."""
    from flashdraft.eval.spec import eval_tau

    t0 = time.perf_counter()
    if cuda_graphs:  # graphs need weights that stay put: a copy, as a served export
        copy = served_copy(drafter, target, device)
        with torch.compiler.set_stance("force_eager"):
            tau = eval_tau(target, tokenizer, copy, prompts, max_new_tokens, cuda_graphs=True)
    else:
        with autocast(device), torch.compiler.set_stance("force_eager"):
            tau = eval_tau(target, tokenizer, drafter, prompts, max_new_tokens)
    return {"tau": tau, "tau_eval_s": time.perf_counter() - t0}


def served_copy(drafter: DFlashDrafter, target: Target, device: torch.device) -> DFlashDrafter:
    """An uncompiled eval-mode copy of the drafter as `flashdraft eval` loads its export: weights
    rounded through the target's dtype (bf16 on a GPU)."""
    dtype = next(target.model.parameters()).dtype
    return drafter_from_state(drafter.config, drafter.state_dict(), device, dtype).eval()
