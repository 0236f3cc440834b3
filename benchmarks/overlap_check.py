"""How much of the optimizer phase hides under the target forward when the two run on separate streams.

It sets up what `flashdraft bench` sets up for a shape (standing in for the bench's measuring function),
warms up, then times the target forward of one micro-batch alone, the optimizer phase alone (the
gradient-norm clip and fused AdamW, over gradients set to noise), and both at once in two arrangements:
the optimizer on a second stream (what training does), and the forward on a second stream of higher
priority with the optimizer on the main one (the GPU's scheduler then gives the forward's blocks the
free slots first). Each figure is a median of --iters, timed on the host around a device sync.

    python benchmarks/overlap_check.py --shape qwen3-8b [--iters 7]
"""

import on_bench_trainer
import torch

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

        side, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)

        def beside(first, second, stream):  # `first` on `stream`, `second` on the main stream
            main = torch.cuda.current_stream()
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                first()
            second()
            main.wait_stream(stream)

        t, o = timed(target, iters), timed(optim, iters)
        print(f"target forward alone {t:.1f} ms, optimizer alone {o:.1f} ms, in turn {t + o:.1f} ms")
        for name, first, second, stream in (
            ("optimizer on a second stream", optim, target, side),
            ("forward on a second stream of higher priority", target, optim, high),
        ):
            b = timed(lambda f=first, s=second, st=stream: beside(f, s, st), iters)
            print(f"{name}: {b:.1f} ms (hidden: {t + o - b:.1f} of {o:.1f} ms)", flush=True)
        raise SystemExit(0)

    return run


if __name__ == "__main__":
    on_bench_trainer.main(__doc__, experiment, 7)
