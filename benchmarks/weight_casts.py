"""What the drafter's weight casts cost in the compiled step: its forward and backward with fp32 weights
under bf16 autocast (what training runs by default), with bf16 weights, and with `train.bf16_weights`.

Training keeps the drafter's weights in fp32 for AdamW. Under autocast every linear casts its weight to
bf16 in the forward, and its weight gradient comes out of a bf16 matmul and is cast to fp32 in the
backward: about 20 bytes of memory traffic a parameter, for a drafter of about a billion. bf16 weights
need none of it, so the difference between the two bounds what `train.bf16_weights` (bf16 copies of the
weights, weight gradients written in fp32 by the matmul; flashdraft.train.precision) can save.

It sets up what `flashdraft bench` sets up for a shape (standing in for the bench's measuring
function), takes one micro-batch's target features and block mask, then times the drafter's forward
and backward (a random gradient on its output), a median of --iters timed on the host around a device
sync: first as training runs it by default, then with the weights cast to bf16 in place, then with
them back in fp32 and bf16 copies (its compiled layers compile again for each).

    python benchmarks/weight_casts.py --shape qwen3-8b [--iters 10]
"""

import on_bench_trainer
import torch

from flashdraft.train.precision import use_bf16_weights
from flashdraft.train.probes import autocast
from flashdraft.train.step import block_visibility
from flashdraft.train.target_attention import _median_ms
from flashdraft.train.timing import NULL_TIMER


def experiment(iters: int):
    def run(trainer, dev, steps, warmup, profile):
        for _ in range(warmup):
            trainer.train_step_guarded()
        m = trainer.micro_indices(trainer.step + 1)[0]
        mb, _ = trainer._micro_batch(m, None, NULL_TIMER)
        vis = block_visibility(trainer.drafter, mb, trainer.spec.kernels)
        drafter, target = trainer.drafter, trainer.target
        with torch.no_grad():
            embeds = target.embed(mb.blocks.input_ids).to(mb.features.dtype)
        grad = torch.randn(*mb.blocks.input_ids.shape, drafter.config.hidden_size, device=dev)

        def forward_backward():
            with autocast(dev):
                hidden = drafter(embeds, mb.blocks.positions, None, vis, mb.features, mb.batch.position_ids)
            hidden.backward(grad.to(hidden.dtype))
            drafter.zero_grad(set_to_none=True)

        params = sum(p.numel() for p in drafter.parameters())
        fp32 = _median_ms(forward_backward, iters)[0]
        drafter.to(torch.bfloat16)
        bf16 = _median_ms(forward_backward, iters, warmup=3)[0]  # the layers compile again
        drafter.float()
        use_bf16_weights(drafter)
        copies = _median_ms(forward_backward, iters, warmup=3)[0]
        print(
            f"drafter forward and backward, {params / 1e9:.2f}B parameters: fp32 weights {fp32:.1f} ms, "
            f"bf16 weights {bf16:.1f} ms (the casts: {fp32 - bf16:.1f} ms a micro-batch at most), "
            f"bf16 copies (train.bf16_weights) {copies:.1f} ms",
            flush=True,
        )
        raise SystemExit(0)

    return run


if __name__ == "__main__":
    on_bench_trainer.main(__doc__, experiment, 10)
