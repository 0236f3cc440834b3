"""The peer's training step: vLLM's speculators 0.9.0 DFlash (or DFlash2) drafter, timed alone at the shape
of one of `flashdraft bench`'s shapes, so that its figures come from the same machine and session as ours.

The drafter is speculators' own model class (`DFlashDraftModel` or `DFlash2DraftModel`), built from its
config classes with our drafter's sizes (width, layers, heads, MLP, taps, vocabulary, block, anchors). It
runs no target: random hidden states of the tapped layers and of the last layer stand in for the target's.
A step is what speculators' trainer does: forward with its own loss under bf16 autocast over fp32 master
weights, backward, grad-norm clip 1.0, then torch.optim.AdamW (fused on a GPU). After the warm-up steps
(the first compiles), the median of the measured steps is reported with the bf16 matmul rate measured in
the same process (flashdraft's `matmul_tflops`). MFU counts the drafter's model FLOPs only, as flashdraft
counts them (train/flops.py): the peer runs no target forward, so its figure flatters it.

speculators is not a flashdraft dependency. On a machine without it, install speculators 0.9.0 and the
few packages its import needs (dev/peer_wheels.sh downloads them), with no dependencies:

    python -m pip install --no-deps --target /tmp/peersite .peer/*.whl   # beside .whl/'s wheels
    PYTHONPATH=/tmp/peersite python benchmarks/peer_step.py --shape qwen3-8b --steps 20 --json peer.json
    [--architecture dflash2] [--no-compile] [--rows-per-batch 1] [--documents 1]

speculators compiles its forward when CUDA is available, and so does this by default. --no-compile runs
it eagerly; add --attention sdpa there, since eager flex attention materialises every score.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version

import torch
import transformers
from transformers import Qwen3Config

from flashdraft.bench import (
    DEFAULT_DOCUMENTS,
    DEFAULT_ROWS,
    QWEN3_MASK_ID,
    QWEN3_VOCAB,
    SyntheticStream,
    shape_config,
)
from flashdraft.config import resolve_config
from flashdraft.model.drafter import drafter_config
from flashdraft.train.build import dflash2_of
from flashdraft.train.flops import matmul_tflops, mfu, micro_batch_flops, sync

# speculators 0.9.0's training defaults (train/config/schema.py): D-PACE-weighted CE for DFlash; DFlash2
# keeps KL with fixed exponential position weights
LOSS = {"dflash": ("ce", "dpace"), "dflash2": ("kl_div", "fixed-exp-decay")}


def unshare_autotune_configs() -> None:
    """speculators 0.9.0 decorates its fused loss's forward and backward kernels with one triton.autotune,
    so both kernels hold the same list of configs. Tracing its compiled forward, dynamo (torch 2.11) meets
    that list under both names and stops ("ListVariable ... is already tracked for mutation"). The
    backward kernel gets a copy: the same configs in a list of its own."""
    from speculators.losses import fused

    kernel = fused.loss_backward_kernel
    if kernel.configs is fused.loss_forward_kernel.configs:
        kernel.configs = list(kernel.configs)


def our_drafter(args):
    """The run config and drafter config `flashdraft bench` builds for these options (bench.run_bench)."""
    tcfg = shape_config(args.shape)
    cfg = resolve_config(
        "default",
        **{
            "data.seq_len": args.seq_len,
            "data.rows_per_batch": args.rows_per_batch,
            "num_anchors": args.anchors,
            "drafter.block_size": args.block_size,
            "drafter.num_layers": args.drafter_layers,
            "drafter.architecture": args.architecture,
            "drafter.num_taps": min(5, tcfg.num_hidden_layers - 3),
        },
    )
    mask_id = QWEN3_MASK_ID if tcfg.vocab_size == QWEN3_VOCAB else tcfg.vocab_size - 1
    d = cfg.drafter
    dcfg = drafter_config(
        tcfg, d.num_layers, d.target_layer_ids, d.num_taps, d.block_size, mask_id, dflash2=dflash2_of(cfg)
    )
    return tcfg, cfg, dcfg


def peer_model(architecture: str, dcfg, attention: str):
    """speculators' drafter of our drafter's sizes, its verifier-owned weights (embedding, lm_head,
    verifier lm_head: NaN until a verifier is loaded) random."""
    try:
        from speculators import SpeculatorModel, SpeculatorsConfig, VerifierConfig
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
        from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
        from speculators.proposals import GreedyTokenProposalConfig
    except ImportError as e:
        raise SystemExit(
            f"speculators 0.9.0 does not import ({e}): install dev/peer_wheels.sh's wheels with "
            "--no-deps and put them on PYTHONPATH (this module's docstring)"
        ) from e
    layer = Qwen3Config(
        vocab_size=dcfg.vocab_size,
        hidden_size=dcfg.hidden_size,
        intermediate_size=dcfg.intermediate_size,
        num_hidden_layers=dcfg.num_hidden_layers,
        num_attention_heads=dcfg.num_attention_heads,
        num_key_value_heads=dcfg.num_key_value_heads,
        head_dim=dcfg.head_dim,
        rms_norm_eps=dcfg.rms_norm_eps,
        max_position_embeddings=dcfg.max_position_embeddings,
        rope_parameters=dict(dcfg.rope_parameters),
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=list(dcfg.layer_types),  # full attention on every layer, as ours
    )
    layer._attn_implementation = attention  # as speculators' from_training_args sets its draft_attn_impl
    fields = dict(
        transformer_layer_config=layer,
        draft_vocab_size=dcfg.vocab_size,  # the full vocabulary: lm_head is the verifier's, frozen
        block_size=dcfg.block_size,
        aux_hidden_state_layer_ids=list(dcfg.target_layer_ids),  # only their count shapes the step
        mask_token_id=dcfg.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm=architecture,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=dcfg.block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    if architecture == "dflash":
        cls, config = DFlashDraftModel, DFlashSpeculatorConfig(**fields)
    else:
        d2 = dcfg.dflash2
        sizes = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        cls, config = DFlash2DraftModel, DFlash2SpeculatorConfig(**fields, **{k: d2[k] for k in sizes})
    model = cls(config)
    with torch.no_grad():
        for head in (model.embed_tokens, model.lm_head, model.verifier_lm_head):
            head.weight.normal_(0.0, 0.02)
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"speculators' drafter holds non-finite weights after initialisation: {bad}")
    SpeculatorModel.verify_training_compatible(model)
    return cls, model


def packed_batches(cfg, dcfg, documents: int, device, dtype, count: int = 2) -> list[dict]:
    """`count` batches in speculators' layout: one packed row [1, rows x seq] holding the rows of
    `flashdraft bench`'s synthetic stream end to end (their documents numbered apart), with random
    hidden states of the tapped layers and of the last layer."""
    stream = SyntheticStream(cfg, dcfg.vocab_size, documents)
    out = []
    for m in range(count):
        b = stream[m]
        rows, seq = b.input_ids.shape
        docs = b.doc_ids + documents * torch.arange(rows)[:, None]
        tokens, width, taps = rows * seq, dcfg.hidden_size, len(dcfg.target_layer_ids)
        out.append(
            {
                "hidden_states": torch.randn(1, tokens, taps * width, dtype=dtype, device=device),
                "input_ids": b.input_ids.reshape(1, -1).to(device),
                "loss_mask": b.loss_mask.reshape(1, -1).bool().to(device),
                "verifier_last_hidden_states": torch.randn(1, tokens, width, dtype=dtype, device=device),
                "document_ids": docs.reshape(1, -1).to(device),
                "position_ids": b.position_ids.reshape(1, -1).to(device),
            }
        )
    return out


def unmatched(args, rows: int, loss: tuple, attention: str, cuda: bool, head_tflop: float) -> list[str]:
    """What of our shape and step the peer's does not reproduce."""
    notes = [
        f"rows: speculators trains on one packed row a step; the {rows} rows of {args.seq_len:,} tokens run "
        f"as one row of {rows * args.seq_len:,} with {rows * args.anchors:,} anchors drawn over all of it "
        f"({args.anchors} a row on average)"
    ] * (rows > 1)
    notes += [
        "target: none; random hidden states stand in for the tapped layers and the last layer",
        f"loss: speculators' {loss[0]} with {loss[1]} position weights against the logits its frozen "
        f"verifier_lm_head computes from the last hidden state ({head_tflop:.1f} TFLOP a step, not counted "
        "in MFU)",
        "tap ids: given as ours; only their number shapes the step",
        "optimizer: torch AdamW over every trainable weight (speculators 0.9.0's CLI defaults to Muon)",
        "attention: full on every layer, as ours (speculators 0.9.0's CLI defaults to a 2,048 window)",
    ]
    if attention != "simple_flex_attention":
        why = "flex attention has no backward on a CPU" if not cuda else "as asked"
        notes.append(f"draft attention: speculators' {attention}, not its default flex attention ({why})")
    if not cuda:
        notes.append("CPU: fp32 without autocast, speculators' eager loss (its fused one is Triton)")
    return notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", help="one of flashdraft bench's shapes")
    ap.add_argument("--architecture", choices=("dflash", "dflash2"), default="dflash")
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512, help="anchors per row")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rows-per-batch", type=int, help="rows per step (default: flashdraft bench's)")
    ap.add_argument("--documents", type=int, help="documents per row (default: flashdraft bench's)")
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="measured steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps (the first compiles)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda when visible)")
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="speculators' compiled forward (default: on CUDA, where speculators compiles it)",
    )
    ap.add_argument(
        "--attention",
        choices=("simple_flex_attention", "sdpa", "eager"),
        help="speculators' draft attention (default: simple_flex_attention, its own; eager on a CPU, where "
        "flex attention has no backward)",
    )
    ap.add_argument("--json", dest="json_out", help="write the figures here")
    args = ap.parse_args()
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps: 1 or more")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    compiled = cuda if args.compile is None else args.compile
    if compiled and not cuda:
        ap.error("--compile: speculators compiles its forward only where CUDA is available")
    args.rows_per_batch = args.rows_per_batch or DEFAULT_ROWS.get(args.shape, 1)
    documents = args.documents or min(DEFAULT_DOCUMENTS, args.seq_len // 32)
    rows, arch = args.rows_per_batch, args.architecture
    attention = args.attention or ("simple_flex_attention" if cuda else "eager")

    torch.manual_seed(0)
    tcfg, cfg, dcfg = our_drafter(args)
    cls, model = peer_model(arch, dcfg, attention)
    model.to(dev).train()
    loss = LOSS[arch]
    call_kwargs, _ = cls.get_trainer_kwargs(
        loss_fn=loss[0],
        loss_implementation="fused" if cuda else "eager",
        per_position_loss_weight=loss[1],
        max_anchors=rows * args.anchors,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=cuda)
    batches = packed_batches(cfg, dcfg, documents, dev, torch.bfloat16 if cuda else torch.float32)

    def step(batch: dict) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            _, loss_value, metrics = model(**batch, **call_kwargs)
        opt.zero_grad()
        loss_value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return metrics["full_acc_total"]  # the positions the loss weighs (the anchor slot is not one)

    if compiled:
        unshare_autotune_configs()
    peak = matmul_tflops(dev)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, positions = [], []
    # --no-compile on CUDA: every compiled function of speculators' runs eagerly (on a CPU it compiles none
    # but its block-mask builder, as it does there)
    with torch.compiler.set_stance("force_eager" if cuda and not compiled else "default"):
        t0 = time.perf_counter()
        try:
            step(batches[0])
        except Exception as e:
            if not compiled:
                raise
            raise RuntimeError(
                f"speculators' compiled first step failed on torch {torch.__version__} (the cause is above); "
                "to run it eagerly: --no-compile --attention sdpa"
            ) from e
        sync(dev)
        first_step = time.perf_counter() - t0
        for k in range(1, args.warmup):
            step(batches[k % len(batches)])
        sync(dev)
        for k in range(args.steps):
            t0 = time.perf_counter()
            positions.append(step(batches[k % len(batches)]))
            sync(dev)
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    flops = micro_batch_flops(cfg, tcfg, dcfg, documents)["drafter"]  # the drafter's part only
    # its verifier_lm_head runs on the block positions, or on the whole row where that is fewer
    head_rows = min(rows * args.anchors * args.block_size, rows * args.seq_len)
    head_tflop = head_rows * 2 * dcfg.hidden_size * dcfg.vocab_size / 1e12
    r = {
        "peer": f"speculators {version('speculators')} {arch}",
        "speculators": version("speculators"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "shape": args.shape,
        "architecture": arch,
        "seq_len": args.seq_len,
        "rows_per_batch": rows,
        "documents": documents,
        "anchors": args.anchors,
        "block_size": args.block_size,
        "drafter": {
            "layers": dcfg.num_hidden_layers,
            "hidden_size": dcfg.hidden_size,
            "heads": dcfg.num_attention_heads,
            "kv_heads": dcfg.num_key_value_heads,
            "head_dim": dcfg.head_dim,
            "intermediate_size": dcfg.intermediate_size,
            "taps": len(dcfg.target_layer_ids),
            "vocab_size": dcfg.vocab_size,
            "trainable_params": sum(p.numel() for p in params),
        },
        "compiled": compiled,
        "attention": attention,
        "loss": f"{loss[0]} ({'fused' if cuda else 'eager'}), {loss[1]} position weights",
        "step_ms": 1000 * step_s,
        "step_ms_per_row": 1000 * step_s / rows,
        "ctx_tok_s": rows * args.seq_len / step_s,
        "draft_pos_s": statistics.median(int(p) for p in positions) / step_s,
        "model_tflops": flops / step_s / 1e12,
        "matmul_tflops": peak,
        "mfu": mfu({"total": flops}, step_s, peak),
        "flops": "the drafter's model FLOPs only (flashdraft's count): the peer runs no target forward",
        "drafter_tflop_per_step": flops / 1e12,
        "uncounted_verifier_head_tflop": head_tflop,
        "target_forward_mfu": None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else 0.0,
        "first_step_s": first_step,
        "steps": args.steps,
        "warmup": args.warmup,
        "times_ms": [round(1000 * t, 2) for t in times],
        "unmatched": unmatched(args, rows, loss, attention, cuda, head_tflop),
    }
    print(
        f"| {r['peer']} ({'compiled' if compiled else 'eager'}), {args.shape}, {rows} x {args.seq_len:,} "
        f"packed | {r['step_ms']:.1f} ms ({r['step_ms_per_row']:.1f} a row) | {r['ctx_tok_s']:,.0f} context "
        f"tok/s | {r['draft_pos_s']:,.0f} draft pos/s | MFU {r['mfu']:.1%} (drafter FLOPs only, "
        f"{peak:.1f} TFLOP/s peak) | {r['peak_mem_gib']:.1f} GiB | first step {first_step:.2f} s |"
    )
    print(f"{r['device']}, torch {r['torch']}, transformers {r['transformers']}; not matched:")
    for note in r["unmatched"]:
        print(f"  - {note}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
