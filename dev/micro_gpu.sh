#!/usr/bin/env bash
# One device call of the attention micro-benchmarks, a few minutes in all:
#   rm -rf .basesrc && mkdir .basesrc && git archive main src benchmarks | tar -x -C .basesrc   # here first
#   bash dev/micro_gpu.sh [flex_backward.py settings]    # carry .whl, .basesrc and .peer
# varlen_check.py (the varlen kernel's grouped heads and its graph), then flex_backward.py twice: this
# tree's script and package, and main's from .basesrc, so that a branch's mask and main's are timed on one
# machine. Each log comes back in $OUT; the end of each is printed. .peer's wheels are installed too, for a
# bench_gpu.sh call after this one on the same machine.
set -uo pipefail
cd "$(dirname "$0")/.."
source dev/site.sh
out=${OUT:-/tmp}
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(s2)
run() {
  local name=$1 path=$2 && shift 2
  echo "== $name"
  PYTHONPATH=$SITE:$path timeout -s KILL 240 python3 "$@" > "$out/$name.log" 2>&1
  echo "exit $?"
  tail -n 12 "$out/$name.log"
}
run varlen_check src dev/varlen_check.py
run flex_head src benchmarks/flex_backward.py --iters 10 --settings "${settings[@]}"
[ -d .basesrc/src ] && run flex_base .basesrc/src .basesrc/benchmarks/flex_backward.py --iters 10 --settings "${settings[@]}"
