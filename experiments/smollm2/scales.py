"""The real-target proofs' scales: H200 for one H200, SMOKE to check the flow on a CPU, for
SmolLM2-135M-Instruct (a chat model) and, as GEMMA3_*, Gemma 3 270M (a base model).

The flow is flashdraft.demo.real_target, whose CPU scale `flashdraft demo --target smollm2` runs.
"""

import dataclasses

from experiments.scratch_target.flow import H200_DRAFTER
from flashdraft.demo.real_target import RealScale

H200 = RealScale(
    device="cuda",
    prompts=8192 + 32,
    code_prompts=8192 + 32,
    held_out=32,
    prompt_tokens=96,  # coding requests run longer: at 32 tokens 11 of 17 did not end
    response_tokens=256,
    batch=4096,
    regen_cache="static",
    sampled=True,
    prepare_procs=8,
    humaneval=96,
    eval_tokens=192,
    temperatures=(0.0, 1.0),
    preset="default",
    train={
        **H200_DRAFTER,
        "epochs": 100,  # the step count comes from the time left, not from passes over the data
        "log_every": 50,
    },
    calibration_steps=5,
    cuda_graphs=True,
    reference_prompts=32,
    # served tau at T = 0 while the drafter trains, on 16 held-out prompts of 96 tokens (CUDA graphs),
    # logged in run/metrics.jsonl: a run stopped before its evals still says where its tau stood
    probes=4,
    probe_prompts=16,
    probe_tokens=96,
)

SMOKE = RealScale(
    prompts=6,
    code_prompts=6,
    held_out=2,
    prompt_tokens=32,
    response_tokens=24,
    batch=8,
    sampled=True,
    humaneval=2,
    eval_tokens=16,
    temperatures=(0.0, 1.0),
    calibration_steps=2,
    reference_prompts=2,
    probes=2,
    probe_prompts=2,
    probe_tokens=8,
)

# Gemma 3 270M: prompts it writes from <bos> and code cut from the standard library, continued at T = 0
# and T = 1; HumanEval as completions. Its 262,144-wide vocabulary makes a loss row 1.7 times SmolLM2's.
# CUDA graphs decode a sliding-window target while its 512-token window holds every position: HumanEval's
# first 64 prompts (282 tokens at most) and 192 new tokens fit, its first 96 (338) do not.
GEMMA3_H200 = dataclasses.replace(H200, target="gemma3", prompt_tokens=96, humaneval=64)
GEMMA3_SMOKE = dataclasses.replace(SMOKE, target="gemma3")
