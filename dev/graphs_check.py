"""On a GPU: decoding replayed as CUDA graphs gives the tokens of eager decoding, at T = 0 and with sampled
drafts at T = 1, for DFlash and DFlash2 (the CPU tests check the fixed-shape path without graphs; this
checks the capture). The tiny models of the test suite; about a minute. Exit 1 on a mismatch.

    PYTHONPATH=src:tests python3 dev/graphs_check.py
"""

import sys

import torch

from flashdraft.eval.spec import run_methods
from flashdraft.model.target import Target
from flashdraft.train.build import dflash2_from_dflash
from test_dflash2_decode import SETTINGS
from test_eval_spec import tiny_setup


def main() -> int:
    s = tiny_setup()
    dflash2 = dflash2_from_dflash(s.trained, SETTINGS, std=0.02, seed=0)
    with torch.no_grad():
        for name, p in dflash2.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.add_(torch.randn(p.shape) * (0.2 if "selector" in name else 0.01))
    model = s.model.cuda()
    bad = 0
    for name, drafter in (("dflash", s.trained), ("dflash2", dflash2)):
        drafter = drafter.cuda().eval()
        target = Target(model, drafter.target_layer_ids)
        for temperature, sampling in ((0.0, "argmax"), (1.0, "sample")):
            runs = [
                run_methods(target, drafter, s.prompts[:4], 48, drafter.block_size, temperature,
                            cuda_graphs=graphs, methods=("dflash",), draft_sampling=sampling)["dflash"]
                for graphs in (False, True)
            ]  # fmt: skip
            same = [
                a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
                for a, b in zip(*runs, strict=True)
            ]
            tau = sum(g.tau for g in runs[1]) / len(runs[1])
            print(f"{name} T={temperature} drafts={sampling}: graphs equal eager {all(same)}, tau {tau:.2f}")
            bad += not all(same)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
