"""The frozen target in FP8 (`target_fp8`): the product is the dequantised one, every decoder-layer
linear is replaced and nothing else, and a run trains on the FP8 target's features."""

import pytest
import torch
from torch import nn

import families
from flashdraft.config import resolve_config, resolve_run_config
from flashdraft.data.packing import save_token_dataset
from flashdraft.model.drafter import drafter_config
from flashdraft.model.fp8 import E4M3, Fp8Linear, to_fp8_
from flashdraft.model.target import Target, decoder_layers, load_target
from flashdraft.train.build import build_trainer
from flashdraft.train.flops import mfu, micro_batch_flops
from helpers import random_docs


def test_an_fp8_linear_computes_the_dequantised_product_and_stays_near_the_original():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(3, 5, 64) * torch.linspace(0.1, 10, 64)  # features of very different scales
    fp8 = Fp8Linear(linear)
    assert fp8.weight.dtype == E4M3 and fp8.weight_scale.shape == (1, 48)
    out = fp8(x)
    # the same numbers dequantised by hand: each token's row and each weight row on its own scale
    rows = x.reshape(-1, 64)
    scale = rows.abs().amax(1, keepdim=True) / 448
    xq = (rows / scale).to(E4M3).float() * scale
    wq = fp8.weight.float() * fp8.weight_scale.t()
    torch.testing.assert_close(out, (xq @ wq.t() + linear.bias).view(3, 5, 48))
    ref = linear(x)
    assert ((out - ref).norm() / ref.norm()) < 0.05  # e4m3 keeps 3 mantissa bits


def test_every_decoder_layer_linear_of_the_target_goes_fp8_and_its_features_stay_close(tiny_target_dir):
    model, _ = load_target(tiny_target_dir, "cpu", layers=4)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    target = Target(model, [1, 3])
    before = target.features(ids)
    linears = sum(isinstance(m, nn.Linear) for m in decoder_layers(model)[2].modules())
    assert to_fp8_(decoder_layers(model)[2]) == (linears, 0) and linears == 4 * 7
    assert not any(isinstance(m, nn.Linear) for m in decoder_layers(model)[2].modules())
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.float32
    after = target.features(ids)
    assert 0 < ((after - before).norm() / before.norm()) < 0.1  # e4m3 through four layers: 6% here


def test_a_run_trains_on_an_fp8_targets_features(tmp_path, tiny_target_dir, capsys):
    save_token_dataset(random_docs([70, 90, 120, 60] * 2, seed=2, prompt_len=10), tmp_path / "data")
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 2}
    over |= {"drafter.num_layers": 1, "drafter.num_taps": 2, "target_fp8": True}
    trainer = build_trainer(
        resolve_config("default", **over), tiny_target_dir, tmp_path / "data", tmp_path / "r"
    )
    assert "target in FP8: 28 linears e4m3" in capsys.readouterr().out
    assert any(isinstance(m, Fp8Linear) for m in trainer.target.model.modules())
    result = trainer.run()
    assert torch.isfinite(torch.tensor([result.first_loss, result.final_loss])).all()
    with pytest.raises(ValueError, match="target_fp8 is for a whole target"):
        resolve_run_config(
            "default", target_fp8=True, **{"run.target": "t", "run.data": "d", "run.out": "o"},
            **{"run.target_parallel": "fsdp:2"},
        )  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3_text", "qwen3_moe", "gpt_oss"])
def test_the_fp8_flops_counted_are_the_linears_converted_and_mfu_takes_them_at_the_fp8_rate(family):
    """micro_batch_flops' `fp8` share is what to_fp8_ converts in the layers that run (routed experts and
    their router stay bf16), and MFU counts that share at the FP8 rate, the rest at the bf16 rate."""
    model = families.build(family, 320, 1, 0)
    layers = decoder_layers(model)[2]
    to_fp8_(layers)
    weights = sum(m.in_features * m.out_features for m in layers.modules() if isinstance(m, Fp8Linear))
    over = {"data.seq_len": 64, "data.rows_per_batch": 3, "num_anchors": 4, "drafter.num_layers": 1}
    cfg = resolve_config("default", target_fp8=True, **over)
    dcfg = drafter_config(model.config, 1, [1, 3], 2, 16, 0)
    flops = micro_batch_flops(cfg, model.config, dcfg)
    assert flops["fp8"] == 3 * 64 * 4 * 2 * weights // len(layers)  # layers 0-3 run
    assert micro_batch_flops(cfg.model_copy(update={"target_fp8": False}), model.config, dcfg)["fp8"] == 0
    total, fp8 = flops["total"], flops["fp8"]
    seconds = (total - fp8) / 100e12 + fp8 / 250e12  # the ideal time at 100 and 250 TFLOP/s
    assert mfu(flops, 2 * seconds, 100.0, 250.0) == pytest.approx(0.5)
    assert mfu(flops, seconds, 100.0, 250.0, gpus=4) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="FP8 matmul rate"):
        mfu(flops, seconds, 100.0)


def test_routed_experts_held_as_linears_stay_bf16():
    layer = nn.Module()
    layer.q_proj = nn.Linear(32, 32)
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.ModuleList([nn.Linear(32, 16) for _ in range(4)])
    layer.mlp.shared_expert = nn.Linear(32, 16)
    assert to_fp8_(nn.ModuleList([layer])) == (2, 0)
    assert all(isinstance(m, nn.Linear) for m in layer.mlp.experts)
    assert isinstance(layer.q_proj, Fp8Linear) and isinstance(layer.mlp.shared_expert, Fp8Linear)
