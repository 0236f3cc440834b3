# Sourced by the device-call scripts: installs the carried wheels (.whl, and .peer where present) once
# into SITE=/root/keep/site, which survives between calls that follow each other closely.
SITE=/root/keep/site
[ -d "$SITE/pydantic" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$SITE" .whl/*.whl $(ls .peer/*.whl 2>/dev/null) || exit 3
