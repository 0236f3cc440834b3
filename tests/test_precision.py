"""train.bf16_weights: linears computing from bf16 copies of their fp32 weights (flashdraft.train.precision).
The CPU runs bf16 autocast here to stand in for a GPU's: a CPU run trains in fp32 and refuses the setting."""

import copy

import pytest
import torch
from torch import nn

from flashdraft.train.precision import Bf16Linear, refresh, use_bf16_weights

DEVICES = ["cpu"] + ["cuda"] * torch.cuda.is_available()


def bf16(device: str = "cpu"):
    return torch.autocast(device, dtype=torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise on the CPU; on a GPU the two products may take different kernels."""
    if a.is_cuda:
        torch.testing.assert_close(a, b)
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_linear_gives_autocasts_output_and_input_gradient_and_an_unrounded_weight_gradient(device):
    torch.manual_seed(0)
    plain = nn.Linear(48, 32).to(device)
    ours = copy.deepcopy(plain)
    (linear,) = use_bf16_weights(wrapped := nn.Sequential(ours))
    assert isinstance(linear, Bf16Linear) and linear.weight is ours.weight
    x = torch.randn(3, 5, 48, device=device)
    dy = torch.randn(3, 5, 32, device=device).bfloat16()
    grads = {}
    for name, module in (("autocast", plain), ("copies", wrapped)):
        xi = x.clone().requires_grad_()
        with bf16(device):
            y = module(xi)
        y.backward(dy)
        weight = module.weight if name == "autocast" else linear.weight
        bias = module.bias if name == "autocast" else linear.bias
        grads[name] = y, xi.grad, weight.grad, bias.grad
    (y0, dx0, dw0, db0), (y1, dx1, dw1, db1) = grads["autocast"], grads["copies"]
    assert y1.dtype == torch.bfloat16 and dx1.dtype == torch.float32
    same(y0, y1)
    same(dx0, dx1)
    assert dw1.dtype == torch.float32 and db1.dtype == torch.float32
    # the weight gradient of the same bf16 operands, summed exactly
    exact = dy.double().reshape(-1, 32).t() @ x.bfloat16().double().reshape(-1, 48)
    ours_error, autocast_error = (dw1 - exact).abs().max(), (dw0 - exact).abs().max()
    assert ours_error < 1e-5 * exact.abs().max() < autocast_error  # autocast's was rounded to bf16
    torch.testing.assert_close(db1, db0, rtol=1e-2, atol=1e-2)


def test_the_copies_follow_their_weights_and_nothing_else_changes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    params, keys = list(model.parameters()), list(model.state_dict())
    reference = copy.deepcopy(model)
    linears = use_bf16_weights(model)
    assert len(linears) == 2 and list(model.parameters()) == params and list(model.state_dict()) == keys
    with torch.no_grad():  # changed in place, as a resume or an init changes them
        for module in (model, reference):
            module[0].weight.mul_(-2)
    x = torch.randn(4, 8)
    with bf16():
        assert torch.equal(model(x), reference(x))  # the forward refreshed the stale copy first
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with bf16():
        model(x).sum().backward()
    opt.step()
    refresh(linears)  # what the trainer does after each optimizer step
    for linear in linears:
        assert torch.equal(linear.weight_bf16, linear.weight.detach().bfloat16())
    assert torch.equal(model(x), nn.functional.linear(torch.relu(model[0](x)), params[2], params[3]))


def test_bf16_weights_is_on_by_default_where_the_drafter_computes_in_bf16_and_refused_where_not(
    tmp_path, tiny_target_dir, token_data_dir, monkeypatch
):
    import flashdraft.train.trainer as trainer_module
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    def linears(name: str, **overrides) -> int:
        cfg = resolve_config("tiny_cpu", max_steps=2, **{"drafter.num_layers": 1, **overrides})
        trainer = build_trainer(cfg, tiny_target_dir, token_data_dir, tmp_path / name, device="cpu")
        trainer.close()
        return len(trainer.bf16_linears)

    assert linears("fp32") == 0  # the default, where the drafter computes in fp32
    cfg = resolve_config("tiny_cpu", max_steps=2, bf16_weights=True)
    with pytest.raises(ValueError, match="bf16_weights: the drafter computes in fp32 on cpu"):
        build_trainer(cfg, tiny_target_dir, token_data_dir, tmp_path / "run", device="cpu")
    with pytest.raises(ValueError, match="bf16_weights cannot be combined with fsdp"):
        resolve_config("tiny_cpu", bf16_weights=True, fsdp=True)
    monkeypatch.setattr(trainer_module, "autocast", lambda device: bf16())
    assert linears("default") == 8  # q, k, v, o, gate, up, down, fc
    assert linears("off", bf16_weights=False) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_training_with_bf16_weights_refreshes_the_copies_at_each_step(
    tmp_path, tiny_target_dir, token_data_dir, monkeypatch, device
):
    """With bf16 autocast (on the CPU standing in for a GPU's), each step ends with every copy equal to
    its updated weight, and the run trains as one without copies does, within bf16 rounding. On a GPU
    the optimizer and the refresh run on a stream of their own, and the layers are compiled."""
    import flashdraft.train.trainer as trainer_module
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    if device == "cpu":
        monkeypatch.setattr(trainer_module, "autocast", lambda device: bf16())
    runs = {}
    for copies in (False, True):
        cfg = resolve_config("tiny_cpu", max_steps=3, bf16_weights=copies, **{"drafter.num_layers": 1})
        out = tmp_path / f"run{copies}"
        trainer = build_trainer(cfg, tiny_target_dir, token_data_dir, out, device=device)
        assert len(trainer.bf16_linears) == (8 if copies else 0)  # q, k, v, o, gate, up, down, fc
        losses = []
        for _ in range(3):
            losses.append(trainer.step_loss(trainer.train_step()))
            for linear in trainer.bf16_linears:
                assert torch.equal(linear.weight_bf16, linear.weight.detach().bfloat16())
        runs[copies] = losses, [p.detach().clone() for p in trainer.drafter.parameters()]
        trainer.close()
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-2)
    # AdamW moves a weight by about lr a step whatever its gradient's size, so where a gradient is near
    # zero its rounding can flip the step's sign: a few weights may differ by up to 2 lr a step (0.018
    # here); nearly all must agree to well within one step
    lr = cfg.optim.lr
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        apart = (a - b).abs()
        assert apart.max() <= 6 * lr * 1.1
        assert (apart > lr / 3).float().mean() < 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_layer_of_bf16_linears_gives_the_eager_outputs_and_gradients(device):
    """A compiled layer traces its backward under the forward's autocast: the weight gradient must still
    be summed in fp32. The inputs are bf16 values, so that the compiled graph's casts round nothing."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 32)).to(device)
    use_bf16_weights(eager)
    compiled = copy.deepcopy(eager)
    for layer in (compiled[0], compiled[2]):
        layer.compile(dynamic=False)
    x = torch.randn(4, 7, 32, device=device).bfloat16().float()
    results = []
    for model in (eager, compiled):
        xi = x.clone().requires_grad_()
        with bf16(device):
            y = model(xi)
        y.float().square().sum().backward()
        results.append((y, xi.grad, [p.grad for p in model.parameters()]))
    (y0, dx0, g0), (y1, dx1, g1) = results
    same(y0, y1)
    same(dx0, dx1)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_resumed_run_with_bf16_weights_ends_bitwise_equal_to_an_uninterrupted_one(
    tmp_path, tiny_target_dir, token_data_dir, monkeypatch
):
    """The resume loads the weights in place after the copies were made: the first forward refreshes
    them, so the resumed steps compute from the saved weights, not from the initial ones."""
    import flashdraft.train.trainer as trainer_module
    from flashdraft.config import resolve_config
    from flashdraft.train.build import build_trainer

    monkeypatch.setattr(trainer_module, "autocast", lambda device: bf16())
    cfg = resolve_config("tiny_cpu", max_steps=4, bf16_weights=True, **{"drafter.num_layers": 1})

    def build(out, resume=False):
        return build_trainer(cfg, tiny_target_dir, token_data_dir, out, device="cpu", resume=resume)

    whole = build(tmp_path / "whole")
    whole.run()
    first = build(tmp_path / "stopped")
    for _ in range(2):
        first.train_step()
    first.save()
    first.close()
    resumed = build(tmp_path / "stopped", resume=True)
    resumed.run()
    expected, got = whole.drafter.state_dict(), resumed.drafter.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
