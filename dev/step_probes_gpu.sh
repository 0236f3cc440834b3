#!/usr/bin/env bash
# One device call of the step's measurement scripts (carry .whl):
#   PROBES="loss_pass moe_gemms moe_fused" bash dev/step_probes_gpu.sh
# PROBES names which to run, in order (default: the qwen3-8b four, about 10 minutes); each runs under
# its own time limit with the options below:
#   overlap_check  the optimizer beside the next target forward, both arrangements (qwen3-8b, 170 s)
#   weight_casts   the drafter with fp32 against bf16 weights (qwen3-8b, 170 s)
#   gemm_shapes    one drafter layer's matmuls, fused and with fp32 weight gradients (qwen3-8b, 120 s)
#   loss_pass      the loss's pass over a chunk of logits, and two candidates (qwen3-8b, 120 s)
#   moe_gemms      qwen3-30b-a3b's expert GEMMs (torch's, padded, our Triton one) against a dense matmul (four rows, 180 s)
#   moe_fused      a Triton MoE forward against the gather_sum experts' (two rows, 180 s)
# Each log comes back in $OUT; the end of each is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
source dev/site.sh
out=${OUT:-/tmp}
declare -A limit=([overlap_check]=170 [weight_casts]=170 [gemm_shapes]=120 [loss_pass]=120
  [moe_gemms]=180 [moe_fused]=180)
declare -A options=([moe_gemms]="--shape qwen3-30b-a3b --rows 4" [moe_fused]="--shape qwen3-30b-a3b --rows 2")
for name in ${PROBES:-overlap_check weight_casts gemm_shapes loss_pass}; do
  echo "== $name"
  # shellcheck disable=SC2086  # the options are words
  PYTHONPATH=$SITE:src timeout -s KILL "${limit[$name]}" python3 "benchmarks/$name.py" \
    ${options[$name]:---shape qwen3-8b} > "$out/$name.log" 2>&1
  echo "exit $?"
  tail -n 16 "$out/$name.log"
done
