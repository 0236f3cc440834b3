"""Print one table from `flashdraft bench --json` files: python benchmarks/summarize.py a.json b.json"""

import json
import sys
from pathlib import Path

cols = ["step_ms", "ctx_tok_s", "draft_pos_s", "model_tflops", "matmul_tflops", "mfu", "peak_mem_gib"]
print("file".ljust(16), *(c.rjust(13) for c in cols), "first_step_s".rjust(13))
for name in sys.argv[1:]:
    path = Path(name)
    if not path.exists():
        print(path.name.ljust(16), "missing")
        continue
    r = json.loads(path.read_text())
    print(path.stem.ljust(16), *(f"{r[c]:13.3f}" for c in cols), f"{r['first_step_s']:13.1f}")
    print("   phases ms:", {k: round(v, 1) for k, v in r["phases_ms"].items()})
    print("   first step ms:", {k: round(v, 1) for k, v in r["first_step_phases_ms"].items()})
    print("  ", r["compile_report"])
