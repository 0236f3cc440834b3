"""How much of the optimizer phase hides under the target forward when the two run on separate streams.

It sets up what `flashdraft bench` sets up for a shape (standing in for the bench's measuring function),
warms up, then times the target forward of one micro-batch alone, the optimizer phase alone (the
gradient-norm clip and fused AdamW, over gradients set to noise), and both at once with the optimizer
on a second stream. Each figure is a median of --iters, timed on the host around a device sync.

    python benchmarks/overlap_check.py --shape qwen3-8b [--iters 7]
"""

import argparse

import torch

import flashdraft.bench as bench
from flashdraft.distributed.parallel import clip_divisor
from flashdraft.train.target_attention import _median_ms
from flashdraft.train.timing import NULL_TIMER


def timed(fn, iters: int) -> float:
    return _median_ms(fn, iters, warmup=1)[0]


def experiment(iters: int):
    def run(trainer, dev, steps, warmup, profile):
        for _ in range(warmup):
            trainer.train_step_guarded()
        torch.cuda.synchronize()
        params = [p for p in trainer.drafter.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = trainer.optimizer
        m = trainer.micro_indices(trainer.step + 1)[0]

        def target():
            trainer.features.get(m, None, NULL_TIMER)

        def optim():
            _, opt.grad_scale = clip_divisor(params, trainer.cfg.optim.grad_clip)
            opt.step()

        side = torch.cuda.Stream()

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                optim()
            target()
            torch.cuda.current_stream().wait_stream(side)

        t, o, b = timed(target, iters), timed(optim, iters), timed(both, iters)
        print(
            f"target forward {t:.1f} ms, optimizer {o:.1f} ms, sum {t + o:.1f}, both at once {b:.1f} ms "
            f"(hidden: {t + o - b:.1f} of {o:.1f} ms)",
            flush=True,
        )
        raise SystemExit(0)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    bench._drafter_bench = experiment(args.iters)
    bench.run_bench(args.shape, steps=1, warmup=3)


if __name__ == "__main__":
    main()
