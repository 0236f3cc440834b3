#!/usr/bin/env bash
# One device call of the step's measurement scripts (carry .whl):
#   PROBES="loss_pass gemm_shapes" bash dev/step_probes_gpu.sh [--shape qwen3-8b]
# PROBES names which to run, in order (default: all four, about 10 minutes):
#   overlap_check  the optimizer beside the next target forward, both arrangements (170 s at most)
#   weight_casts   the drafter with fp32 against bf16 weights (170 s)
#   gemm_shapes    one drafter layer's matmuls, fused and with fp32 weight gradients (120 s)
#   loss_pass      the loss's pass over a chunk of logits, and two candidates (120 s)
# Each log comes back in $OUT; the end of each is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
source dev/site.sh
out=${OUT:-/tmp}
shape=("$@")
[ ${#shape[@]} -gt 0 ] || shape=(--shape qwen3-8b)
declare -A limit=([overlap_check]=170 [weight_casts]=170 [gemm_shapes]=120 [loss_pass]=120)
for name in ${PROBES:-overlap_check weight_casts gemm_shapes loss_pass}; do
  echo "== $name"
  PYTHONPATH=$SITE:src timeout -s KILL "${limit[$name]}" python3 "benchmarks/$name.py" "${shape[@]}" \
    > "$out/$name.log" 2>&1
  echo "exit $?"
  tail -n 16 "$out/$name.log"
done
