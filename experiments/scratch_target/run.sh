#!/usr/bin/env bash
# The scratch-target proof as flashdraft commands, from the repository root.
# Latest result (one H200): tau 5.20-5.41 at T = 0, 2.70-2.77x plain decoding (README.md here).
#
#   experiments/scratch_target/run.sh runs/proof                          # one GPU
#   MINUTES=5 experiments/scratch_target/run.sh runs/proof                # train at most 5 minutes; run again to continue
#   SMOKE=1 STEPS=4 experiments/scratch_target/run.sh /tmp/smoke          # tiny shapes on a CPU: the flow only
set -euo pipefail
out=${1:?usage: $0 OUT}
steps=${STEPS:-3400}
if [ -n "${SMOKE:-}" ]; then
    scale=(--smoke) device=(--device cpu) graphs=() tokens=32 config=experiments/scratch_target/smoke.yaml
else
    scale=() device=() graphs=(--cuda-graphs) tokens=128 config=configs/scratch_target_h200.yaml
fi

# 1. tokenizer and target trained on Python source, conversations it rewrites, shards, eval prompts
resume=()
[ -f "$out/proof.json" ] && resume=(--resume)
python -m experiments.scratch_target.proof --out "$out" "${scale[@]}" "${resume[@]}" --stop-after-prepare

# 2. the drafter (a run stopped by MINUTES or a kill continues from its last checkpoint)
run=(--target "$out/target" --data "$out/data" --max-steps "$steps" "${device[@]}")
[ -n "${MINUTES:-}" ] && run+=(--max-minutes "$MINUTES")
if [ -f "$out/drafter/checkpoints/LATEST" ]; then
    flashdraft train --config "$config" --resume "$out/drafter" "${run[@]}"
else
    flashdraft train --config "$config" --out "$out/drafter" "${run[@]}"
fi
last=$out/drafter/checkpoints/$(cat "$out/drafter/checkpoints/LATEST")
if [ "$((10#${last##*_}))" -lt "$steps" ]; then
    echo "drafter at ${last##*/} of $steps steps: run the same command again to continue"
    exit 0
fi

# 3. the held-out prompts at T = 0 (the reference package beside ours) and T = 1
for t in 0 1; do
    reference=()
    [ "$t" = 0 ] && python -c "import dflash" 2>/dev/null && reference=(--reference)
    flashdraft eval --target "$out/target" --drafter "$last" --prompts "$out/eval/prompts.jsonl" \
        --max-new-tokens "$tokens" --temperature "$t" "${device[@]}" "${graphs[@]}" "${reference[@]}" \
        --out "$out/eval/flashdraft_t$t.json"
done
