# Sourced by the device-call scripts: installs the carried wheels (.whl, and .peer where carried) into
# SITE=/root/keep/site, which survives between calls that follow each other closely. Each set is
# installed once; .peer also when a call before this one on the same machine carried no .peer.
SITE=/root/keep/site
install_wheels() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$@"; }
[ -d "$SITE/pydantic" ] || install_wheels .whl/*.whl || exit 3
if ls .peer/*.whl > /dev/null 2>&1 && [ ! -d "$SITE/speculators" ]; then
  install_wheels .peer/*.whl || exit 3
fi
