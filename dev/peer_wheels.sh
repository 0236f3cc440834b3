#!/usr/bin/env bash
# Downloads, into .peer/, vLLM's speculators 0.9.0 (the peer benchmarks/peer_step.py times) and exactly the
# wheels its import of the DFlash and DFlash2 models needs that the lent GPU image and .whl/ lack: about 2 MB,
# all pure Python. speculators/__init__.py imports every model; EAGLE-3's data module imports
# speculators.train.data, which imports openai (+ distro, sniffio; its anyio, httpx and pydantic are the
# image's and .whl/'s) and hs_connectors, and datasets (.whl/). Nothing else it declares (aiohttp,
# loguru, jiter, pydantic-settings, torchvision, ...) is imported on that path. Not a flashdraft
# dependency. On the GPU machine, after .whl/'s wheels:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/peersite .peer/*.whl
#   PYTHONPATH=/tmp/site:/tmp/peersite python3 benchmarks/peer_step.py --shape qwen3-8b --steps 20
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.peer/' .git/info/exclude 2>/dev/null || echo '/.peer/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .peer \
  speculators==0.9.0 hs-connectors==0.9.0 \
  openai==2.54.0 distro==1.9.0 sniffio==1.3.1  # openai 3 wants httpx2, which the image lacks
ls -l .peer
