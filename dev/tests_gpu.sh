#!/usr/bin/env bash
# One device call of the test files that have CUDA cases (carry .whl and .testwhl):
#   bash dev/tests_gpu.sh [pytest arguments; default: the files below]
# The GPU image has no pytest: .testwhl holds its wheels (bash dev/gpu_wheels.sh downloads them), which
# are installed once into /root/keep/tests. The files' CPU cases run too.
set -uo pipefail
cd "$(dirname "$0")/.."
source dev/site.sh
[ -d /root/keep/tests/pytest ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /root/keep/tests .testwhl/*.whl || exit 3
[ $# -gt 0 ] || set -- tests/test_row_ce.py tests/test_precision.py tests/test_loss.py
PYTHONPATH=$SITE:/root/keep/tests:src timeout -s KILL "${TESTS_S:-300}" \
  python3 -m pytest -p no:cacheprovider -o addopts="" -q -rs "$@"
