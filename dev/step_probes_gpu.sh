#!/usr/bin/env bash
# One device call of the step's measurement scripts, about 8 minutes in all (carry .whl):
#   bash dev/step_probes_gpu.sh [--shape qwen3-8b]
# benchmarks/overlap_check.py (the optimizer beside the next target forward, both arrangements),
# benchmarks/weight_casts.py (the drafter with fp32 against bf16 weights) and benchmarks/gemm_shapes.py
# (one drafter layer's matmuls, fused and with fp32 weight gradients), each under its own time limit.
# Each log comes back in $OUT; the end of each is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
source dev/site.sh
out=${OUT:-/tmp}
shape=("$@")
[ ${#shape[@]} -gt 0 ] || shape=(--shape qwen3-8b)
run() {
  local name=$1 limit=$2 && shift 2
  echo "== $name"
  PYTHONPATH=$SITE:src timeout -s KILL "$limit" python3 "$@" > "$out/$name.log" 2>&1
  echo "exit $?"
  tail -n 16 "$out/$name.log"
}
run overlap_check 170 benchmarks/overlap_check.py "${shape[@]}"
run weight_casts 170 benchmarks/weight_casts.py "${shape[@]}"
run gemm_shapes 120 benchmarks/gemm_shapes.py "${shape[@]}"
