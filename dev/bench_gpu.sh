#!/usr/bin/env bash
# One device call of benchmarks/bench_medians.py on the lent GPU (a call runs at most 10 minutes).
# Here first: bash dev/gpu_wheels.sh; bash dev/peer_wheels.sh, then carry .whl and .peer in each call:
#   bash dev/bench_gpu.sh NAME [bench_medians.py options, e.g. --runs 3 --config ... -- --steps 20]
# The wheels are installed once into /root/keep/site; the runs go to /root/keep/bench/NAME, so a call
# with the same NAME and options continues the series where the last one stopped. The table is printed
# and NAME's JSON files and logs come back in $OUT.
set -uo pipefail
started=$(date +%s)
cd "$(dirname "$0")/.."
source dev/site.sh
name=$1 && shift
left=$((${CALL_S:-575} - $(date +%s) + started))  # CALL_S: seconds this call may take
export PYTHONPATH=$SITE:$PWD/src
timeout -s KILL "$left" python3 benchmarks/bench_medians.py --out "/root/keep/bench/$name" \
  --budget-s $((left - 100)) "$@" > /tmp/series.log
rc=$?
grep failed /tmp/series.log
python3 benchmarks/bench_medians.py --out "/root/keep/bench/$name" --budget-s -1 "$@"  # the table
tar czf "${OUT:-/tmp}/bench_$name.tgz" -C /root/keep/bench "$name"
exit $rc
