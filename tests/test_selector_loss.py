"""The training term of DFlash2's candidate selector (train/loss.py `selector_loss`): the chunked loss
computes what a position-by-position computation does, for both gold modes, compiled or not; with
stop_gradient the rest of the drafter learns from the base loss alone; the weight's schedule; a run's
selector learns what the logits cannot; DDP needs no unused-parameter search; the config names its
field; the model FLOPs count it."""

import json
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from flashdraft.config import resolve_config
from flashdraft.model.dflash2 import CandidateSelector, DFlash2Settings, scale_and_cap
from flashdraft.model.target import Target
from flashdraft.train.loss import SELECTOR_SUMS, SelectorObjective, block_loss
from flashdraft.train.step import Kernels, micro_step_loss, plan_micro_batch, selector_objective
from helpers import BLOCK, GAMMA, MASK_ID, packed_batch, tiny_drafter, tiny_target

K, RANK, SCALE, CAP = 4, 5, 1.5, 6.0


def _selector(vocab: int, d: int, seed: int) -> CandidateSelector:
    """A selector far from its start (whose pairwise scores are all 0)."""
    torch.manual_seed(seed)
    selector = CandidateSelector(vocab, d, RANK, K)
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_(0.0, 0.6)
    return selector


def _blocks(seed: int = 0, b: int = 2, n: int = 3, bs: int = 5, d: int = 8, vocab: int = 13):
    """Hidden states, an lm_head, labels and weights in which some labels are the argmax, some among
    the top-k and some outside it; a masked label and an empty block."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n * bs, d, generator=g)
    head = torch.randn(vocab, d, generator=g)
    labels = torch.randint(0, vocab, (b, n, bs), generator=g)
    logits = (hidden @ head.t()).view(b, n, bs, vocab)
    labels[0, 0] = logits[0, 0].argmax(-1)  # a block of hits
    labels[1, 0, 2:] = logits[1, 0, 2:].topk(3, -1).indices[:, 2]  # third best: inside the top-k
    weights = torch.rand(b, n, bs, generator=g) + 0.1
    weights[:, :, 0] = 0
    weights[0, 1, 3] = 0  # a masked label ends its block's run
    weights[1, 2] = 0  # an empty block
    return hidden, head, labels, weights


def _pairwise(selector, gate, previous, candidates):
    """Each candidate's score given the previous token, written out: sum over the rank of
    predecessor_codebook[previous] x gate x successor_codebook[candidate]."""
    return (selector.predecessor_codebook[previous] * gate * selector.successor_codebook[candidates]).sum(-1)


def _direct(selector, hidden, head, labels, weights, gold: str):
    """Position by position: the top-k of the scaled and capped logits, the label injected in the
    lowest candidate's place (or the position skipped) when outside it, each candidate's logit plus
    its pairwise score given the true previous token, the cross-entropy to the label; the selector's
    greedy path walked from each anchor on its own picks (not the true previous tokens)."""
    b, n, bs = labels.shape
    h = hidden.view(b, n, bs, -1)
    weighted = weight_sum = recalled = correct = accepted = 0.0
    for r in range(b):
        for j in range(n):
            chosen, run, running = labels[r, j, 0], 0, True
            for s in range(1, bs):
                y, w = labels[r, j, s], weights[r, j, s]
                logits = scale_and_cap(h[r, j, s] @ head.t(), SCALE, CAP)
                unary, candidates = logits.topk(K)
                gate = selector.hidden_projection(h[r, j, s])
                pair = partial(_pairwise, selector, gate)
                served = unary + pair(labels[r, j, s - 1], candidates)
                pick = candidates[served.argmax()]
                # the walk: conditioned on its own previous pick
                chosen = candidates[(unary + pair(chosen, candidates)).argmax()]
                running = running and bool(w > 0) and bool(chosen == y)
                run += running
                if w > 0:
                    recalled += float(y in candidates)
                    correct += float(pick == y)
                if y not in candidates:
                    if gold == "skip":
                        continue
                    candidates = torch.cat([candidates[:-1], y[None]])
                    unary = torch.cat([unary[:-1], logits[y][None]])
                scores = unary + pair(labels[r, j, s - 1], candidates)
                target = int((candidates == y).nonzero())
                weighted = weighted + w * -torch.log_softmax(scores, -1)[target]
                weight_sum += float(w)
            if (weights[r, j] > 0).any():
                accepted += 1 + run
    return weighted, weight_sum, recalled, correct, accepted


@pytest.mark.parametrize("gold", ["inject", "skip"])
@pytest.mark.parametrize("vocab", [13, 8192])  # 8,192: the top-k by blocks (32 of 256)
def test_the_selector_term_is_a_position_by_position_computation_of_it(gold, vocab):
    hidden, head, labels, weights = _blocks(vocab=vocab)
    selector = _selector(head.shape[0], hidden.shape[-1], seed=0)
    objective = SelectorObjective(0.3, gold=gold, stop_gradient=False)
    hidden.requires_grad_()
    out = block_loss(
        hidden, head, labels, weights, chunk_rows=5, logit_scale_and_cap=(SCALE, CAP),
        selector=selector, selector_objective=objective, selector_alpha=0.3,
    )  # fmt: skip
    mine = dict(zip(SELECTOR_SUMS, out.selector, strict=True))
    params = [hidden, *selector.parameters()]
    grads = torch.autograd.grad(out.weighted_ce, params)

    weighted, weight_sum, recalled, correct, accepted = _direct(selector, hidden, head, labels, weights, gold)
    logits = scale_and_cap(hidden.view(2, 3, 5, -1)[:, :, 1:] @ head.t(), SCALE, CAP)
    base = (F.cross_entropy(logits.flatten(0, 2), labels[:, :, 1:].flatten(), reduction="none")
            * weights[:, :, 1:].flatten()).sum()  # fmt: skip
    torch.testing.assert_close(mine["base_ce"], base.detach())
    torch.testing.assert_close(mine["selector_ce"], weighted.detach())
    torch.testing.assert_close(out.weighted_ce, base + 0.3 * weighted)
    torch.testing.assert_close(grads, torch.autograd.grad(base + 0.3 * weighted, params))
    assert (mine["selector_weight"], mine["recalled"]) == (pytest.approx(weight_sum), recalled)
    assert (mine["selector_correct"], mine["selector_accepted"]) == (correct, accepted)
    positions = float((weights > 0).sum())
    assert 0 < recalled < positions and 0 < correct < recalled  # the data has each kind of position
    if vocab == 13:  # a run of several, not the argmax's (the wider vocabulary's labels are rarely hits)
        assert 1 < accepted - out.blocks < out.accepted - out.blocks
    assert float(out.per_block.sum()) == accepted  # validation walks the selector's path, as decoding does
    if gold == "skip":
        assert weight_sum < weights.sum()


@pytest.mark.parametrize("width", [262144, 151936, 8192, 8191])  # blocks of 256, 128, 256; torch.topk
def test_the_top_k_by_blocks_is_torchs_top_k(width):
    """The same values, sorted, as torch.topk; indices that hold them, each once. Rows of few distinct
    values (many ties, as bf16 logits have), and rows whose top-k all lie in one block."""
    from flashdraft.train.loss import top_k_by_blocks

    g = torch.Generator().manual_seed(width)
    x = torch.randint(-40, 40, (6, width), generator=g).bfloat16()
    x[3] = torch.randn(width, generator=g).bfloat16()
    x[4, 512:528] = 100 + torch.arange(16.0)  # the whole top-k in one block
    x[5, -16:] = 100 - torch.arange(16.0)  # in the last block
    top = top_k_by_blocks(x, 16)
    expected = x.topk(16)
    assert torch.equal(top.values, expected.values)
    assert torch.equal(x.gather(-1, top.indices), top.values)
    assert all(len(set(row.tolist())) == 16 for row in top.indices)
    assert torch.equal(top.indices[4].sort().values, torch.arange(512, 528))


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the top-k and argmax kernels that run under it, and the scatters that put a gradient of
    the top-k or of a gathered logit back into a [positions, vocab] tensor."""

    def __init__(self):
        super().__init__()
        self.counts = {"topk": 0, "argmax": 0, "scatter": 0}
        self.topk_inputs = []  # the dtype of each top-k's input

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        name = "scatter" if "scatter" in name else name
        if name == "topk":
            self.topk_inputs.append(args[0].dtype)
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stop_gradient", [True, False])
def test_the_backward_computes_what_has_a_gradient_only(stop_gradient):
    """When the selector's term stops at its own parameters, the top-k and the label's logit carry no
    gradient: the backward puts none back into [positions, vocab] tensors, and a chunk's recompute takes
    no top-k; it never takes the argmax. The loss and every gradient are those of a loss kept whole."""
    hidden, head, labels, weights = _blocks()
    selector = _selector(head.shape[0], hidden.shape[-1], seed=0)
    objective = SelectorObjective(0.3, gold="inject", stop_gradient=stop_gradient)
    runs = {}
    for recompute in (True, False):
        h = hidden.clone().requires_grad_()
        out = block_loss(
            h, head, labels, weights, chunk_rows=5, recompute=recompute, logit_scale_and_cap=(SCALE, CAP),
            selector=selector, selector_objective=objective, selector_alpha=0.3,
        )  # fmt: skip
        with _Ops() as backward:
            grads = torch.autograd.grad(out.weighted_ce, [h, *selector.parameters()])
        runs[recompute] = out, grads, backward.counts
    (kept, kept_grads, kept_ops), (recomputed, grads, ops) = runs[False], runs[True]
    torch.testing.assert_close(recomputed.weighted_ce, kept.weighted_ce)
    torch.testing.assert_close(recomputed.selector, kept.selector)
    torch.testing.assert_close(grads, kept_grads)
    chunks = -(-hidden.shape[0] * 3 * 4 // 5)  # 2 x 3 blocks of 4 draft positions, 5 rows a chunk
    assert ops["topk"] == (0 if stop_gradient else chunks) and ops["argmax"] == kept_ops["argmax"] == 0
    assert (kept_ops["scatter"] == 0) == (ops["scatter"] == 0) == stop_gradient


def test_the_top_k_reads_the_matmuls_output_rather_than_an_fp32_copy_of_the_logits():
    """The candidates come from the bf16 product itself (the cast to fp32 is exact and the multiplier and
    cap keep the order), so no [positions, vocab] fp32 tensor is written for the top-k alone: 5 GB a
    chunk at Qwen3's vocabulary. Their tokens and scores are those of the capped fp32 logits."""
    from flashdraft.train.loss import _chunk_ce

    hidden, head, labels, _ = _blocks(vocab=97)
    h, head = hidden.flatten(0, 1).bfloat16(), head.bfloat16()
    with _Ops() as ops:
        _, _, values, index, _ = _chunk_ce(h, head, labels.flatten(), None, 0.0, SCALE, CAP, K)
    assert ops.topk_inputs == [torch.bfloat16]
    top = scale_and_cap((h @ head.t()).float(), SCALE, CAP).topk(K)
    assert torch.equal(index, top.indices) and torch.equal(values, top.values)


SETTINGS = DFlash2Settings(
    conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=4, output_multiplier=1.5,
    final_logit_softcapping=4.0,
)  # fmt: skip


def _dflash2(seed: int = 0):
    """The tests' tiny target with peaked logits, and a DFlash2 drafter whose selector is far from its
    neutral start."""
    from test_dflash2 import dflash2_drafter, peaked_target

    model = peaked_target(seed)
    drafter = dflash2_drafter(model, SETTINGS, seed).train()
    return Target(model, drafter.target_layer_ids), drafter


def _gradients(drafter, target, mb, selector: SelectorObjective | None, recompute: bool) -> dict:
    drafter.zero_grad(set_to_none=True)
    kernels = Kernels("dense", recompute_logits=recompute, selector=selector)
    micro_step_loss(drafter, target, mb, kernels, step=10).weighted_ce.backward()
    return {k: p.grad for k, p in drafter.named_parameters()}


@pytest.mark.parametrize("recompute", [True, False])
def test_with_stop_gradient_the_selector_term_trains_the_selector_alone(recompute):
    """stop_gradient: every parameter outside the selector gets exactly the base loss's gradient, the
    selector a non-zero one; without it, the term reaches the rest of the drafter too."""
    target, drafter = _dflash2()
    batch = packed_batch([[40, 30], [70]], seq_len=72)
    mb = plan_micro_batch(batch, 4, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0))
    base = _gradients(drafter, target, mb, None, recompute)
    stopped = _gradients(drafter, target, mb, SelectorObjective(0.5, stop_gradient=True), recompute)
    through = _gradients(drafter, target, mb, SelectorObjective(0.5, stop_gradient=False), recompute)
    own = [k for k in base if k.startswith("candidate_selector.")]
    rest = [k for k in base if k not in own]
    assert len(own) == 3 and all(base[k] is None for k in own)
    assert all(stopped[k].abs().sum() > 0 for k in own)
    assert all(torch.equal(stopped[k], base[k]) for k in rest)
    assert all(torch.equal(through[k], stopped[k]) for k in own)
    assert not torch.allclose(through["fc.weight"], base["fc.weight"])


def test_the_selector_weight_is_zero_through_warmup_then_ramps_linearly_to_alpha():
    ramped = SelectorObjective(0.4, warmup_steps=3, ramp_steps=4)
    weights = [ramped.alpha_at(s) for s in range(1, 10)]
    assert weights == pytest.approx([0, 0, 0, 0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert ramped.alpha_at(None) == 0.4  # outside training (validation): the full weight
    assert [SelectorObjective(0.4, warmup_steps=2).alpha_at(s) for s in (1, 2, 3)] == [0, 0, 0.4]
    assert SelectorObjective(0.4).alpha_at(1) == 0.4


def test_the_step_sets_the_selector_terms_weight_in_the_loss():
    target, drafter = _dflash2()
    batch = packed_batch([[40, 30], [70]], seq_len=72)
    mb = plan_micro_batch(batch, 4, BLOCK, MASK_ID, GAMMA, torch.Generator().manual_seed(0))
    kernels = Kernels("dense", selector=SelectorObjective(0.4, warmup_steps=3, ramp_steps=4))
    with torch.no_grad():
        for step, alpha in ((2, 0.0), (5, 0.2), (40, 0.4)):
            out = micro_step_loss(drafter, target, mb, kernels, step=step)
            sums = dict(zip(SELECTOR_SUMS, out.selector, strict=True))
            assert out.selector_alpha == pytest.approx(alpha)
            torch.testing.assert_close(out.weighted_ce, sums["base_ce"] + alpha * sums["selector_ce"])
    assert sums["selector_ce"] > 0


@pytest.mark.parametrize(
    "over, message",
    [
        ({"selector.alpha": -0.1}, "selector.alpha\n.*greater than or equal to 0"),
        ({"selector.gold": "drop"}, "selector.gold\n.*'inject' or 'skip'"),
        ({"selector.ramp_steps": -1}, "selector.ramp_steps\n"),
        ({"selector.stop_gradient": "maybe"}, "selector.stop_gradient\n"),
        ({"drafter.architecture": "dflash", "selector.alpha": 0.5}, "selector.alpha trains a DFlash2"),
        (
            {"selector.warmup_steps": 10},
            "selector.warmup_steps trains a DFlash2 drafter's candidate selector",
        ),
    ],
)
def test_selector_settings_are_checked_with_the_field_named(over, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("tiny_cpu", **over)


def test_the_selector_weight_defaults_by_architecture():
    """Unset, 0.5 for a DFlash2 drafter; a DFlash drafter trains no selector, and a weight for one (its
    architecture known only once init_from is read) is refused."""
    _, dflash2 = _dflash2()
    dflash = tiny_drafter(tiny_target())
    default = resolve_config("tiny_cpu").selector
    assert selector_objective(default, dflash2) == SelectorObjective(0.5)
    assert selector_objective(default, dflash) is None
    assert resolve_config("tiny_cpu", **{"selector.alpha": 0}).selector.alpha == 0  # allowed for dflash
    with pytest.raises(ValueError, match="selector.alpha 0.5: a dflash drafter has no candidate selector"):
        selector_objective(default.model_copy(update={"alpha": 0.5}), dflash)


def _phrases(count: int = 3, docs: int = 24, seed: int = 0) -> list[dict]:
    """Documents of two-token phrases drawn at random: a phrase's first token is anyone's guess, its
    second follows from the first. Two slots on, the logits can only spread over the second tokens;
    given the true first token, the selector can know it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(docs):
        ids = [t for i in torch.randint(0, count, (60,), generator=g).tolist() for t in (10 + i, 40 + i)]
        out.append({"input_ids": ids, "loss_mask": [0] * 4 + [1] * (len(ids) - 4)})
    return out


RUN_DFLASH2 = {
    "drafter.architecture": "dflash2", "drafter.conv_group_size": 16, "drafter.selector_rank": 8,
    "drafter.selector_top_k": 4, "drafter.num_layers": 1, "drafter.block_size": 4, "gamma": 4.0,
    "data.seq_len": 128, "data.rows_per_batch": 2,
}  # fmt: skip


def test_a_runs_selector_learns_where_the_previous_token_decides_the_next(tmp_path, tiny_target_dir):
    from flashdraft.data.packing import save_token_dataset
    from flashdraft.train.build import build_trainer

    save_token_dataset(_phrases(), tmp_path / "data")
    over = {"num_anchors": 16, "max_steps": 40, "log_every": 1, "optim.lr": 1e-2, "optim.warmup_ratio": 0.0,
            "position_weights": "gamma", "selector.alpha": 1.0, "selector.warmup_steps": 2,
            "selector.ramp_steps": 4, "val_data": str(tmp_path / "data"), "val_batches": 2}  # fmt: skip
    cfg = resolve_config("tiny_cpu", **RUN_DFLASH2, **over)
    build_trainer(cfg, tiny_target_dir, tmp_path / "data", tmp_path / "run", "cpu").run()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # gold skip (the default): a step none of whose labels is among the candidates has no selector loss
    first, last = next(m for m in logged if m["candidate_recall"] > 0), logged[-1]
    assert last["selector_loss"] < 0.6 * first["selector_loss"]
    assert [m["selector_alpha"] for m in logged[:7]] == [0, 0, 0.25, 0.5, 0.75, 1, 1]  # set by the step
    assert 0 < last["candidate_recall"] <= 1
    # measured at every anchor of the held-out batches: the selector's teacher-forced picks and its
    # path beat the argmax's
    assert last["val_selector_acc"] > last["val_acc_mean"] + 0.1
    assert last["val_selector_tau_train"] > last["val_tau_train"]
    # alpha 1: the selector's mean over the positions it counts, weighted by their share of the step's
    assert last["base_loss"] < last["loss"] < last["base_loss"] + last["selector_loss"]


@pytest.mark.slow  # inductor compiles on the CPU
@pytest.mark.parametrize("recompute", [False, True])
def test_the_compiled_loss_computes_the_eager_selector_term_in_one_graph_a_chunk(recompute):
    from flashdraft.train import loss

    hidden, head, labels, weights = _blocks(b=2, n=6, bs=4, d=16, vocab=97)  # 36 rows: chunks 16, 16, 4
    selector = _selector(97, 16, seed=0)
    objective = SelectorObjective(0.5, stop_gradient=False)
    args = (hidden.flatten(0, 1)[:16], head, labels.flatten()[:16], None, 0.0, SCALE, CAP, K)
    assert torch._dynamo.explain(loss._chunk_ce)(*args).graph_break_count == 0
    torch._dynamo.reset()
    runs = {}
    for compiled in (False, True):
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as a GPU step computes
            out = block_loss(
                h, head.to(torch.bfloat16), labels, weights, chunk_rows=16, recompute=recompute,
                compiled=compiled, logit_scale_and_cap=(SCALE, CAP), selector=selector,
                selector_objective=objective, selector_alpha=0.5,
            )  # fmt: skip
        out.weighted_ce.backward()
        runs[compiled] = out, h.grad, selector.successor_codebook.grad.clone()
        selector.zero_grad()
    (eager, eager_grad, eager_codebook), (fused, fused_grad, fused_codebook) = runs[False], runs[True]
    torch.testing.assert_close(fused.selector, eager.selector, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.weighted_ce, eager.weighted_ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(fused_codebook, eager_codebook, rtol=1e-4, atol=1e-5)


DDP_CONFIG = """
data: {seq_len: 128, rows_per_batch: 1}
num_anchors: 8
log_every: 1
grad_accum: %d
drafter: {num_layers: 1, num_taps: 2, block_size: 8, architecture: dflash2, conv_group_size: 16,
          selector_rank: 8, selector_top_k: 4}
selector: {alpha: 0.5, stop_gradient: %s}
"""


def _train(tmp_path, target, data, name: str, grad_accum: int, stop_gradient: bool, *extra) -> tuple:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(DDP_CONFIG % (grad_accum, str(stop_gradient).lower()))
    out = tmp_path / name
    cmd = [sys.executable, "-m", "flashdraft.cli.main", "train", "--target", str(target), "--data",
           str(data), "--out", str(out), "--config", str(cfg), "--max-steps", "3", "--device", "cpu",
           *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    state = torch.load(out / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=True)
    return metrics, state["master"]


@pytest.mark.slow
@pytest.mark.parametrize("stop_gradient, sharded", [(True, False), (True, True), (False, False)])
def test_two_ranks_train_a_dflash2_drafter_as_one_process(
    tmp_path, tiny_target_dir, token_data_dir, stop_gradient, sharded
):
    """Every parameter has a gradient each step (the selector's from its term), so DDP runs without
    searching the graph for unused ones; two ranks (DDP, or FSDP2, whose root module holds the selector)
    give one process's losses, metrics and weights."""
    one = _train(tmp_path, tiny_target_dir, token_data_dir, "one", 4, stop_gradient)
    extra = ("--nproc", "2", "--fsdp") if sharded else ("--nproc", "2")
    two = _train(tmp_path, tiny_target_dir, token_data_dir, "two", 2, stop_gradient, *extra)
    logged = ("loss", "base_loss", "selector_loss", "candidate_recall", "selector_acc", "selector_tau_train")
    for key in logged:
        assert [m[key] for m in two[0]] == pytest.approx([m[key] for m in one[0]], abs=1e-5), key
    for k, v in one[1].items():
        torch.testing.assert_close(two[1][k], v, atol=1e-5, rtol=1e-4)
    assert two[1]["candidate_selector.hidden_projection.weight"].abs().sum() > 0  # zero at the start


def test_the_model_flops_count_the_convolutions_kernels_and_the_selector():
    """Per draft position, forward and backward (6 FLOPs a weight): the convolutions' kernel projections;
    per position through the lm_head, the selector's hidden projection and its k + 1 pairwise scores."""
    from flashdraft.model.drafter import drafter_config
    from flashdraft.train.flops import step_flops

    model = tiny_target()
    dflash = drafter_config(model.config, 2, None, 2, BLOCK, MASK_ID)
    _, drafter = _dflash2()
    counts = {
        name: sum(p.numel() for k, p in drafter.named_parameters() if name in k)
        for name in ("kernel_projection", "hidden_projection")
    }
    extra = 6 * (100 * counts["kernel_projection"]) + 6 * 70 * (
        counts["hidden_projection"] + SETTINGS.selector_rank * (SETTINGS.selector_top_k + 1)
    )
    ours, theirs = (step_flops(model.config, c, 3, 64, 100, 70)["drafter"] for c in (drafter.config, dflash))
    assert ours - theirs == extra
