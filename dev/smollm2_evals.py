"""The SmolLM2 proof's evals from what a GPU run sent back, on this machine's CPU or on a GPU: its packed
prompts and answers (`proofdata.tgz.part-*`) and its drafter (`drafter.tgz.part-*`, as dev/smollm2_gpu.sh
returns them).

For the reports a GPU run did not reach: the same prompts (HumanEval's first
--humaneval problems, the held-out synthesized turns of --prompts; `--data` is needed only for these),
the same 192 new tokens, the same `flashdraft eval` comparison (plain decoding, DFlash, n-gram). Tau is
a property of the drafter and the target, not of the machine, up to bf16 rounding (which can flip a
near-tie of the greedy path: `--calibrate N` decodes HumanEval's first N at T = 0 here, to set beside
the GPU's report on the same prompts); on a CPU, tokens/s and speedup say nothing of the GPU's.
`--device cuda` decodes as the proof's eval stage does (bf16, CUDA graphs): a drafter whose run stopped
before the evals is served on the GPU on its own.
`--reference N` decodes HumanEval's first N at T = 0 with the reference `dflash` package on the z-lab
export and counts the prompts where its tau equals ours (our tau from the --calibrate report, on this
machine). Each report is written to OUT/eval/ when done; the same command skips those there. A CPU
report of 64 prompts takes over an hour with all three methods (1.3 minutes a HumanEval prompt on 2
cores): `--dflash-only` decodes DFlash alone, the --calibrate report too (the n-gram baseline's tau
does not depend on the drafter: a GPU report of the same prompts and seeds has it; `--ngram-only`
decodes it alone where none has) and `--first N` takes each report's first N prompts.

    python -m dev.smollm2_evals --data DIR_OF_PROOFDATA_PARTS --drafter DIR_OF_DRAFTER_PARTS \
        --out runs/cpu_evals --prompts 24576 --report humaneval_t1 --report held_out_t0 --calibrate 32 \
        --reference 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import time
from pathlib import Path

from experiments.smollm2.scales import H200
from flashdraft.data.humaneval import humaneval_prompts
from flashdraft.demo.real_target import gguf_to_hf, prompt_split, reference_on_prompts, smollm2_gguf
from flashdraft.eval.report import compare_methods, print_table, write_report
from flashdraft.eval.spec import METHODS


def unpack(parts_dir: Path, stem: str, into: Path) -> None:
    """Join `stem`.part-* (in name order) and untar them into `into`, written aside and renamed."""
    parts = sorted(parts_dir.glob(f"{stem}.part-*"))
    if not parts:
        raise SystemExit(f"{parts_dir}: no {stem}.part-* files")
    tmp = into.with_name(f".{into.name}.tmp")
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    tmp.mkdir(parents=True)
    cat = subprocess.Popen(["cat", *map(str, parts)], stdout=subprocess.PIPE)
    subprocess.run(["tar", "xz", "-C", str(tmp)], stdin=cat.stdout, check=True)
    if cat.wait():
        raise SystemExit(f"{parts_dir}: could not read {stem}.part-*")
    tmp.rename(into)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="folder of proofdata.tgz.part-* (the held-out reports)")
    ap.add_argument("--drafter", type=Path, required=True, help="folder of drafter.tgz.part-*")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, required=True, help="the GPU run's --prompts (held-out split)")
    ap.add_argument("--humaneval", type=int, default=64)
    ap.add_argument("--report", action="append", default=[], help="humaneval_t1, held_out_t0, ...")
    ap.add_argument("--calibrate", type=int, default=0, help="HumanEval's first N at T = 0 here")
    ap.add_argument("--reference", type=int, default=0, help="the reference package on those N")
    ap.add_argument("--dflash-only", action="store_true", help="the --report reports decode DFlash alone")
    ap.add_argument("--ngram-only", action="store_true", help="the --report reports decode n-gram alone")
    ap.add_argument("--first", type=int, help="each --report report's first N prompts")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 and CUDA graphs, as the proof)")
    args = ap.parse_args()

    out = args.out
    if args.data and not (out / "data").is_dir():
        unpack(args.data, "proofdata.tgz", out / "data")
    if not (out / "drafter").is_dir():
        unpack(args.drafter, "drafter.tgz", out / "drafter")
    (checkpoint,) = (out / "drafter").iterdir()
    target_dir = gguf_to_hf(smollm2_gguf(), out / "target")
    count = args.prompts + H200.held_out
    cuda = args.device == "cuda"
    scale = dataclasses.replace(H200, device=args.device, cuda_graphs=cuda, prompts=count, code_prompts=count)
    sets = {"humaneval": humaneval_prompts()[: args.humaneval]}
    if (out / "data").is_dir():
        sets["held_out"] = prompt_split(out / "data", scale)[1]
    sets = {k: v[: args.first] for k, v in sets.items()}
    sets["calibrate"] = humaneval_prompts()[: args.calibrate]
    reports = list(args.report) + (["calibrate_t0"] if args.calibrate else [])
    for key in reports:
        name, _, t = key.rpartition("_t")
        if name not in sets or t not in ("0", "1"):
            known = sorted(sets)  # held_out with --data
            raise SystemExit(f"--report {key}: one of {known} followed by _t0 or _t1 (held_out: --data)")
        path = out / "eval" / f"{key}.json"
        alone = "dflash" if args.dflash_only else "ngram" if args.ngram_only else None
        methods = (alone,) if alone and not (key == "calibrate_t0" and alone == "ngram") else METHODS
        if methods != METHODS:
            path = path.with_name(f"{key}_{alone}.json")
        if not path.is_file():
            started = time.time()
            report = compare_methods(
                target_dir, checkpoint, [r["messages"] for r in sets[name]], scale.eval_tokens, float(t),
                device=args.device, cuda_graphs=cuda, methods=methods,
            )  # fmt: skip
            report["wall_s"] = round(time.time() - started, 1)
            if methods == METHODS:
                write_report(report, path)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(report, indent=1))
        report = json.loads(path.read_text())
        if methods == METHODS:
            print(f"{name}, T = {t}")
            print_table(report)
        else:
            print(f"{name}, T = {t}, {alone} alone:", report[alone]["tau"])
    if args.reference:
        names = ("calibrate_t0.json", "calibrate_t0_dflash.json")  # all methods, or DFlash alone
        calibrated = next((out / "eval" / n for n in names if (out / "eval" / n).is_file()), None)
        if calibrated is None:
            raise SystemExit(f"--reference: no {out / 'eval'}/calibrate_t0*.json; add --calibrate N")
        ours = json.loads(calibrated.read_text())["dflash"]["tau_per_sample"]
        n = min(args.reference, len(ours))
        started = time.time()
        ref = reference_on_prompts(checkpoint, target_dir, out, sets["humaneval"][:n], scale, ours[:n])
        ref["wall_s"] = round(time.time() - started, 1)
        (out / "eval" / "reference.json").write_text(json.dumps(ref, indent=1))
        print(json.dumps({k: v for k, v in ref.items() if not isinstance(v, list)}))


if __name__ == "__main__":
    main()
