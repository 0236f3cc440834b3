"""`flashdraft train --plan`: the layout, each rank's memory and the expected throughput, printed
before anything is loaded (the target's config only, no weights).

Memory per rank, in bf16 where not said otherwise:
- target: the decoder layers a rank loads (up to the last tap; all of them for distill), divided over
  its target group with `--target-parallel fsdp:N`, plus two layers gathered whole (the one running and
  the next), and the embedding and lm_head, which every rank holds whole;
- drafter: fp32 weights, gradients and two AdamW moments (16 bytes a parameter, divided over the
  drafter ranks with fsdp);
- activations: ACTIVATION_BYTES per draft position, scaled by the lm_head's width and the drafter's
  layers, from one measurement (below); a first guess for other shapes, not a measurement of them.
Throughput: the time of one micro-batch on each side (model FLOPs at the fraction of the H200's matmul
peak that side reached), divided by the ranks of that side; the slower side sets the pace. A sharded
target all-gathers its loaded layers once per micro-batch; FSDP2 overlaps that with the layers' compute,
so the target side takes the longer of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashdraft.config import TrainConfig
from flashdraft.distributed.layout import Layout, TargetParallel
from flashdraft.model.drafter import drafter_config
from flashdraft.train.flops import layer_matmul_params, micro_batch_flops

# Fraction of the bf16 matmul peak each side reached on the H200 for qwen3-8b and the paper's
# drafter (docs/results.md): the compiled target forward, 43.0 TFLOP in 67.4 ms, 80%; the drafter's
# forward, loss, backward and optimizer, 71.9 TFLOP in 159 ms, 57%. The drafter's attention masks
# and 151,936-wide loss run further from peak, so equal FLOPs are not equal time.
EFFICIENCY = {"target": 0.80, "drafter": 0.57}
PEAK_TFLOPS = 802  # bf16 matmul rate measured on the H200 (docs/results.md)
# Assumed, not measured: NCCL all-gather bus bandwidth over NVLink on 8 H200s.
ALLGATHER_GBPS = 300
# Activations per draft position and per (vocab + 8 x hidden x drafter layers) element: the qwen3-8b bench
# (1 row x 3,072 tokens, 512 anchors x 16, 5-layer drafter) peaked at 47.0 GiB, 30.1 of them weights and
# optimizer state, so 16.9 GiB of activations over 8,192 draft positions.
ACTIVATION_BYTES = 16.9 * 2**30 / (512 * 16 * (151936 + 8 * 4096 * 5))


@dataclass
class Plan:
    layout: str
    world_size: int
    roles: list[str]
    target_gib: float  # per target rank: its share of the loaded layers and two layers gathered whole
    tables_gib: float  # the embedding and lm_head, on every rank
    drafter_gib: float  # per drafter rank: weights, gradients, AdamW moments
    activation_gib: float
    target_tflop_per_micro: float
    drafter_tflop_per_micro: float
    target_s: float  # one micro-batch on one target rank: compute, or the all-gather when longer
    drafter_s: float
    gather_gb: float  # all-gathered per micro-batch by a rank of a sharded target
    target_parallel: str
    tokens_per_micro: int
    micro_per_step: int

    @property
    def step_s(self) -> float:
        lay = Layout.parse(self.layout)
        if lay.is_split:  # each side's ranks share the step's micro-batches
            return max(self.target_s / lay.targets, self.drafter_s / lay.drafters) * self.micro_per_step
        return (self.target_s + self.drafter_s) * self.micro_per_step / self.world_size

    def lines(self) -> list[str]:
        tp = f", target parallelism {self.target_parallel}" if self.target_parallel != "none" else ""
        out = [f"layout {self.layout} on {self.world_size} process(es){tp}"]
        out += [f"  rank {r}: {role}" for r, role in enumerate(self.roles)]
        colocated = not Layout.parse(self.layout).is_split
        tables, rest = self.tables_gib, self.drafter_gib + self.activation_gib
        if colocated:
            out.append(
                f"memory per rank: ~{self.target_gib + tables + rest:.1f} GiB: target layers "
                f"{self.target_gib:.1f}, embedding and lm_head {tables:.1f}, drafter and optimizer "
                f"{self.drafter_gib:.1f}, activations {self.activation_gib:.1f} (a first guess)"
            )
        else:
            out.append(
                f"memory: target ranks ~{self.target_gib + tables:.1f} GiB (layers {self.target_gib:.1f}), "
                f"drafter ranks ~{tables + rest:.1f} GiB (drafter and optimizer {self.drafter_gib:.1f}, "
                f"activations {self.activation_gib:.1f}: a first guess)"
            )
        out.append(
            f"work per micro-batch: target {self.target_tflop_per_micro:.1f} TFLOP, "
            f"drafter {self.drafter_tflop_per_micro:.1f} TFLOP"
        )
        if self.gather_gb:
            compute = self.target_tflop_per_micro / (EFFICIENCY["target"] * PEAK_TFLOPS)
            out.append(
                f"sharded target: {self.gather_gb:.1f} GB all-gathered per micro-batch, "
                f"{self.gather_gb / ALLGATHER_GBPS:.2f} s at {ALLGATHER_GBPS} GB/s (assumed) against "
                f"{compute:.2f} s of target compute"
            )
        if not colocated:
            lay = Layout.parse(self.layout)
            share = (self.target_s / lay.targets) / (self.drafter_s / lay.drafters)
            busy_t, busy_d = min(1.0, share), min(1.0, 1 / share)
            eff = f"target at {EFFICIENCY['target']:.0%}, drafter at {EFFICIENCY['drafter']:.0%} of peak"
            out.append(
                f"expected busy fraction: target ranks {busy_t:.0%}, drafter ranks {busy_d:.0%} ({eff}, H200)"
            )
        rate = self.tokens_per_micro * self.micro_per_step / self.step_s
        out.append(
            f"expected: {self.step_s:.2f} s a step of {self.micro_per_step} micro-batches, "
            f"~{rate:,.0f} context tokens/s (H200 at {PEAK_TFLOPS} TFLOP/s)"
        )
        return out


def make_plan(
    cfg: TrainConfig,
    target_config,
    layout: str | Layout,
    world_size: int,
    target_parallel: str | TargetParallel = "none",
) -> Plan:
    lay = Layout.parse(layout).on(world_size)
    tp = TargetParallel.parse(target_parallel)
    if tp.sharded:
        tp.groups(lay)  # the target ranks split into groups of N, or this is an error
    spec = cfg.drafter
    dcfg = drafter_config(
        target_config, spec.num_layers, spec.target_layer_ids, spec.num_taps, spec.block_size, 0,
        spec.intermediate_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
        spec.rope_theta,
    )  # fmt: skip
    t = target_config.get_text_config()
    head_params = 2 * t.vocab_size * t.hidden_size
    drafter_params = (
        layer_matmul_params(dcfg) * dcfg.num_hidden_layers + len(dcfg.target_layer_ids) * t.hidden_size**2
    )
    flops = micro_batch_flops(cfg, target_config, dcfg)
    target_tf, drafter_tf = flops["target"] / 1e12, flops["drafter"] / 1e12
    loaded = t.num_hidden_layers if cfg.distill or cfg.eval_every else max(dcfg.target_layer_ids) + 1
    layer_bytes = 2 * layer_matmul_params(t, active=False)
    if cfg.target_fp8:  # its converted linears hold one byte a weight
        layer_bytes -= layer_matmul_params(t, active=False, routed=False)
    gather_gb = loaded * layer_bytes * (tp.size - 1) / tp.size / 1e9 if tp.sharded else 0.0
    fp8_tf = flops["fp8"] / 1e12  # at twice the bf16 rate
    compute_s = (target_tf - fp8_tf / 2) / (EFFICIENCY["target"] * PEAK_TFLOPS)
    target_s = max(compute_s, gather_gb / ALLGATHER_GBPS)
    drafter_s = drafter_tf / (EFFICIENCY["drafter"] * PEAK_TFLOPS)
    positions = cfg.data.rows_per_batch * cfg.num_anchors * dcfg.block_size
    activations = positions * ACTIVATION_BYTES * (t.vocab_size + 8 * t.hidden_size * dcfg.num_hidden_layers)
    gathered = 2 * layer_bytes if tp.sharded else 0
    gib = 2**30
    return Plan(
        layout=str(lay),
        world_size=world_size,
        roles=["target + drafter"] * world_size
        if not lay.is_split
        else ["target"] * lay.targets + ["drafter"] * lay.drafters,
        target_gib=(loaded * layer_bytes / tp.size + gathered) / gib,
        tables_gib=2 * head_params / gib,
        drafter_gib=16 * drafter_params / (lay.drafters if cfg.fsdp else 1) / gib,
        activation_gib=activations / gib,
        target_tflop_per_micro=target_tf,
        drafter_tflop_per_micro=drafter_tf,
        target_s=target_s,
        drafter_s=drafter_s,
        gather_gb=gather_gb,
        target_parallel=str(tp),
        tokens_per_micro=cfg.data.rows_per_batch * cfg.data.seq_len,
        micro_per_step=cfg.grad_accum * lay.drafters,
    )
