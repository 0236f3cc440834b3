"""`flashdraft train --plan`: the layout, each rank's memory and the expected target/drafter balance,
printed before anything is loaded (the target's config only, no weights).

Memory per rank: target weights (bf16, every layer: the loaded model stays whole) on target ranks; on drafter
ranks the drafter's fp32 weights, gradients and two AdamW moments (16 bytes a parameter, divided
over the drafter ranks with fsdp) plus the target's embedding and lm_head. Balance: the time of
one micro-batch on each side (model FLOPs at the fraction of the matmul peak that side reached on
the H200), divided by the ranks of that side; the slower side sets the pace and the other side
idles by the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashdraft.config import TrainConfig
from flashdraft.distributed.layout import Layout
from flashdraft.model.drafter import drafter_config
from flashdraft.train.flops import layer_matmul_params, micro_batch_flops

# Fraction of the bf16 matmul peak each side reached on the H200 for qwen3-8b and the paper's
# drafter (docs/results.md, fourth measurement): the compiled target forward, 43.0 TFLOP in 67.4 ms,
# 80%; the drafter's forward, loss, backward and optimizer, 71.9 TFLOP in 159 ms, 57%. The drafter's
# attention masks and 151,936-wide loss run further from peak, so equal FLOPs are not equal time.
EFFICIENCY = {"target": 0.80, "drafter": 0.57}


@dataclass
class Plan:
    layout: str
    world_size: int
    roles: list[str]
    target_gib: float
    drafter_gib: float
    target_tflop_per_micro: float
    drafter_tflop_per_micro: float
    target_share: float  # relative work per target rank / per drafter rank (1.0 = balanced)

    def lines(self) -> list[str]:
        out = [f"layout {self.layout} on {self.world_size} process(es)"]
        out += [f"  rank {r}: {role}" for r, role in enumerate(self.roles)]
        out.append(
            f"memory: target ranks ~{self.target_gib:.1f} GiB of weights, "
            f"drafter ranks ~{self.drafter_gib:.1f} GiB"
        )
        out.append(
            f"work per micro-batch: target {self.target_tflop_per_micro:.1f} TFLOP, "
            f"drafter {self.drafter_tflop_per_micro:.1f} TFLOP"
        )
        if Layout.parse(self.layout).is_split:
            busy_t = min(1.0, self.target_share)
            busy_d = min(1.0, 1 / self.target_share)
            eff = f"target at {EFFICIENCY['target']:.0%}, drafter at {EFFICIENCY['drafter']:.0%} of peak"
            out.append(
                f"expected busy fraction: target ranks {busy_t:.0%}, drafter ranks {busy_d:.0%} ({eff}, H200)"
            )
        return out


def make_plan(cfg: TrainConfig, target_config, layout: str | Layout, world_size: int) -> Plan:
    lay = Layout.parse(layout).on(world_size)
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
    if not lay.is_split:
        roles = ["target + drafter"] * world_size
        share = 1.0
    else:
        roles = ["target"] * lay.targets + ["drafter"] * lay.drafters
        target_time = target_tf / EFFICIENCY["target"] / lay.targets
        share = target_time / (drafter_tf / EFFICIENCY["drafter"] / lay.drafters)
    gib = 2**30
    return Plan(
        layout=str(lay),
        world_size=world_size,
        roles=roles,
        target_gib=(t.num_hidden_layers * layer_matmul_params(t, active=False) + head_params) * 2 / gib,
        drafter_gib=(16 * drafter_params / (lay.drafters if cfg.fsdp else 1) + 2 * head_params) / gib,
        target_tflop_per_micro=target_tf,
        drafter_tflop_per_micro=drafter_tf,
        target_share=share,
    )
