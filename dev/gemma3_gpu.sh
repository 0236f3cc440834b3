#!/usr/bin/env bash
# One device call of the Gemma 3 270M proof (`python -m experiments.smollm2.proof --target gemma3`) on the
# lent GPU (calls under 10 minutes, at most 64 MiB carried in, files back of at most 16 MiB; see
# dev/README.md). After `bash dev/carry_gemma.sh split` here, the calls, each within 30 s of the last:
#   call 0 (carry .whl .gemma0):  bash dev/gemma3_gpu.sh site
#   call 1 (carry .gemma1):       bash dev/carry_gemma.sh keep
#   calls 2-4 (carry .gemma2, .gemma3, .gemma4):  bash dev/carry_gemma.sh keep
#   call 5 (optional, 5 minutes):  the regeneration settings against the target alone (dev/regen_check.py)
#                                 bash dev/gemma3_gpu.sh run --minutes 4 --stop-after prompts && \
#                                   PYTHONPATH=/root/keep/site:src python3 dev/regen_check.py \
#                                   /root/keep/gproof/target /root/keep/gproof/prompts.code.jsonl --batch 64
#   call 6..:                     bash dev/gemma3_gpu.sh run [proof options, e.g. --minutes 9.3]
# `run` joins the chunks once (hash checked), then continues the proof in /root/keep/gproof where it
# stopped; logs, the summary, the evals and (with SEND_DRAFTER=1) the drafter's weights (15 MiB parts) come
# back in $OUT, and, once, after the regenerate stage, the prompts and answers (gproofdata.tgz.part-*,
# `pack`). Copied into .gemma0/ they travel with call 0, and a later proof on a fresh machine starts from
# them (dev/packed.py seeds it), skipping the prompts and regenerate stages (about 4 minutes of the H200).
set -uo pipefail
started=${CALL_STARTED:-$(date +%s)}
cd "$(dirname "$0")/.."
SITE=/root/keep/site PROOF=/root/keep/gproof LOGS=/root/keep/glogs
GGUF=/root/keep/gemma/gemma-3-270m-q4_k_m.gguf
case "${1:-}" in
  site)  # the wheels flashdraft needs that the GPU image lacks
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
      $(ls .gemma0/*.whl 2>/dev/null) || exit 3
    if ls .gemma0/gproofdata.t?z* >/dev/null 2>&1; then mkdir -p /root/keep && cp .gemma0/gproofdata.t?z* /root/keep/; fi ;;
  run)
    shift
    [ -f "$GGUF" ] || bash dev/carry_gemma.sh join || exit 3
    packed=$(ls /root/keep/gproofdata.t?z* 2>/dev/null | head -1)
    if [ -n "$packed" ] && [ ! -f "$PROOF/summary.json" ]; then  # another run's prompts and answers
      mkdir -p "$PROOF" && cat "${packed%.part-*}"* | tar xz -C "$PROOF" || exit 3
      PYTHONPATH=$SITE:$PWD/src python3 dev/packed.py seed "$PROOF" || exit 3
      echo "proof seeded from ${packed%.part-*}*: prompts and answers kept"
    fi
    mkdir -p "$LOGS"
    n=$(ls "$LOGS" | wc -l)
    minutes=9
    for ((i = 1; i < $#; i++)); do [ "${!i}" = --minutes ] && j=$((i + 1)) && minutes=${!j}; done
    limit=$(python3 -c "print(min(588, int(60 * $minutes) + 10))") || exit 2
    PYTHONPATH=$SITE:$PWD/src:$PWD FLASHDRAFT_GEMMA3_GGUF=$GGUF timeout -s KILL $((limit - $(date +%s) + started)) \
      python3 -m experiments.smollm2.proof --target gemma3 --out "$PROOF" --started "$started" "$@" \
      > "$LOGS/call$n.log" 2>&1
    rc=$?
    grep -v "it/s\]\|examples/s\]" "$LOGS/call$n.log" | tail -40
    tar czf "${OUT:-/tmp}/gproof_logs.tgz" -C /root/keep glogs gproof/summary.json gproof/run/metrics.jsonl \
      gproof/eval $(cd /root/keep && ls gproof/*.failed.jsonl 2>/dev/null) 2>/dev/null
    if [ ! -f /root/keep/gproofdata.sent ] && python3 -c "import json, sys; \
        sys.exit('regenerate' not in json.load(open('$PROOF/summary.json')).get('stages', []))" 2>/dev/null; then
      files=$(PYTHONPATH=$SITE:$PWD/src python3 dev/packed.py files "$PROOF") && (cd "$PROOF" && tar czf - $files) \
        | split -b 15M -d - "${OUT:-/tmp}/gproofdata.tgz.part-" && touch /root/keep/gproofdata.sent
    fi
    ckpt=$(python3 -c "import json; print(json.load(open('$PROOF/summary.json')).get('checkpoint', ''))" 2>/dev/null)
    # the drafter's weights only when asked (SEND_DRAFTER=1): a DFlash2 drafter for this vocabulary is 153M
    # parameters, whose archive took a minute of the call and came back in part
    if [ -n "${SEND_DRAFTER:-}" ] && [ -n "$ckpt" ] && [ -d "$ckpt" ] \
        && [ "$(cat /root/keep/gdrafter.sent 2>/dev/null)" != "$ckpt" ]; then
      tar czf - -C "$(dirname "$ckpt")" --exclude trainer_state.pt --exclude compile_cache.bin "$(basename "$ckpt")" \
        | split -b 15M -d - "${OUT:-/tmp}/gdrafter.tgz.part-" && echo "$ckpt" > /root/keep/gdrafter.sent
    fi
    exit $rc ;;
  *) echo "usage: gemma3_gpu.sh site|run [proof options]" >&2; exit 2 ;;
esac
