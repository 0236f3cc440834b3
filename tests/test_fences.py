"""The installed package is the product: no module under src/flashdraft imports the proofs and studies
(experiments/), the remote-GPU tools (dev/), or the folders they replaced (recipes/, scripts/)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "flashdraft"
FENCED = ("experiments", "dev", "recipes", "scripts")

# every flashdraft module imported in a fresh interpreter started at the repository root, where the
# fenced folders are importable: whatever they pull in shows in sys.modules
IMPORT_EVERY_MODULE = f"""
import importlib, json, pkgutil, sys
import flashdraft

failed = {{}}
for module in pkgutil.walk_packages(flashdraft.__path__, "flashdraft.", onerror=lambda name: None):
    try:
        importlib.import_module(module.name)
    except Exception as e:  # a module that needs what a CPU machine lacks
        failed[module.name] = repr(e)
fenced = sorted(n for n in sys.modules if n.split(".")[0] in {FENCED!r})
print(json.dumps({{"imported": sorted(n for n in sys.modules if n.startswith("flashdraft.")),
                  "failed": failed, "fenced": fenced}}))
"""


def fenced_imports(path: Path) -> list[str]:
    """The absolute imports of a source file whose top-level name is a fenced folder."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [name for name in names if name.split(".")[0] in FENCED]


def test_no_package_source_file_imports_experiments_or_dev():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20
    found = {str(p.relative_to(ROOT)): names for p in sources if (names := fenced_imports(p))}
    assert found == {}, f"the package imports fenced folders: {found}"


def test_importing_every_package_module_loads_nothing_from_experiments_or_dev():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert len(report["imported"]) > 20
    assert report["fenced"] == [], f"importing the package loaded {report['fenced']}"
    blamed = {m: e for m, e in report["failed"].items() if any(f"'{name}" in e for name in FENCED)}
    assert blamed == {}, f"modules that failed on a fenced import: {blamed}"
