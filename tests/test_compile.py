"""Compiled training: warm-up, persistent cache, and a recompile after warm-up is an error."""

import dataclasses
import os

import pytest
import torch

from flashdraft.config import resolve_config
from flashdraft.data.packing import collate_rows, save_token_dataset
from flashdraft.train.build import build_trainer
from flashdraft.train.compile import RecompileError
from helpers import random_docs

pytestmark = pytest.mark.slow


def test_a_recompile_after_warm_up_stops_the_run_with_a_clear_message(tmp_path, tiny_target_dir, monkeypatch):
    # the trainer points inductor at its cache through the environment: keep that inside this test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    save_token_dataset(random_docs([70, 90, 120, 60] * 2, seed=1, prompt_len=10), tmp_path / "data")
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 4, "compile": True}
    over.update({"drafter.num_layers": 1, "drafter.num_taps": 2})
    prompts = tmp_path / "prompts.jsonl"  # tau during training: the run loads the whole target to decode
    prompts.write_text('{"messages": [{"role": "user", "content": "def f():"}]}\n')
    over.update({"eval_every": 100, "eval_prompts": str(prompts)})
    cfg = resolve_config("default", **over)
    trainer = build_trainer(cfg, tiny_target_dir, tmp_path / "data", tmp_path / "run", device="cpu")
    try:
        trainer.train_step_guarded()  # warm-up: compiles the drafter layers
        assert trainer.compile_report is not None and trainer.compile_report.seconds > 0
        core = trainer.drafter  # the layers and the two norms outside them are compiled
        modules = (*core.layers, core.norm, core.hidden_norm)
        assert all(m._compiled_call_impl is not None for m in modules)
        trainer.train_step_guarded()  # same shapes: no recompile
        # tau during training decodes with ever-changing shapes: eagerly, not as a recompile error
        trainer.tau_probe = (None, [[5, 6, 7, 8, 9, 10], [11, 12, 13]])
        tau = trainer.measure_tau()["tau"]
        assert 1.0 <= tau <= 16.0
        # on fixed-shape caches (CUDA graphs on a GPU): an uncompiled copy with the drafter's weights
        import flashdraft.eval.spec as spec

        seen, eval_tau = {}, spec.eval_tau
        monkeypatch.setattr(spec, "eval_tau", lambda *a, **k: seen.update(a=a, k=k) or eval_tau(*a, **k))
        trainer.cfg = trainer.cfg.model_copy(update={"eval_cuda_graphs": True})
        assert trainer.measure_tau()["tau"] == tau
        copy = seen["a"][2]
        assert seen["k"] == {"cuda_graphs": True} and copy is not trainer.drafter and not copy.training
        mine = trainer.drafter.state_dict()
        assert all(torch.equal(v, mine[k]) for k, v in copy.state_dict().items()) and len(mine) > 0
        trainer.cfg = trainer.cfg.model_copy(update={"eval_cuda_graphs": False})
        trainer.train_step_guarded()
        docs = random_docs([150, 100], seed=2, prompt_len=10)
        odd = collate_rows([[d] for d in docs], 160, pad_token_id=0)  # a row length the warm-up never saw
        trainer.features.stream = {trainer.step: odd, trainer.step + 1: odd}  # micro-batch m = step - 1
        trainer.ahead = None  # fetched from the old stream at the end of the last step
        with pytest.raises(RecompileError, match="recompile after warm-up"):
            trainer.train_step_guarded()
    finally:
        torch.compiler.set_stance("default")


def test_a_compiled_target_computes_the_eager_features_without_recompiling(
    tmp_path, tiny_target_dir, monkeypatch
):
    from flashdraft.model.target import Target, load_target

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    save_token_dataset(random_docs([70, 90, 120, 60] * 2, seed=1, prompt_len=10), tmp_path / "data")
    over = {"data.seq_len": 128, "data.rows_per_batch": 2, "num_anchors": 8, "max_steps": 4, "compile": True}
    over.update({"drafter.num_layers": 1, "drafter.num_taps": 2, "compile_target": True})
    cfg = resolve_config("default", **over)
    trainer = build_trainer(cfg, tiny_target_dir, tmp_path / "data", tmp_path / "run", device="cpu")
    try:
        layers = trainer.target.model.get_decoder().layers
        assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers)
        trainer.train_step_guarded()  # warm-up compiles the target layers too
        trainer.train_step_guarded()  # a recompile here would be an error
        trainer.val_loader = trainer.stream.loader  # validation reuses the training graphs: no recompile
        assert 1.0 <= trainer.validate()["val_tau_train"] <= 16.0
        batch = trainer.stream[0]
        eager = Target(load_target(tiny_target_dir)[0], trainer.target.layer_ids)
        torch.testing.assert_close(
            trainer.target.features(batch.input_ids, batch.position_ids),
            eager.features(batch.input_ids, batch.position_ids),
        )
    finally:
        torch.compiler.set_stance("default")
    with pytest.raises(ValueError, match="compile_target needs compile"):
        build_trainer(
            resolve_config("default", **{**over, "compile": False}),
            tiny_target_dir,
            tmp_path / "data",
            tmp_path / "run2",
            device="cpu",
        )


@pytest.mark.parametrize("compile", [True, False])
def test_the_compile_workers_start_before_the_target_loads_when_the_run_compiles(monkeypatch, compile):
    import flashdraft.train.build as build_module
    from flashdraft.bench import _UNUSED_OUT, shape_config, shape_source
    from flashdraft.config import run_config

    events = []
    monkeypatch.setattr(build_module, "start_compile_workers", lambda: events.append("workers"))
    source = shape_source("tiny", shape_config("tiny"))
    load = source.load_target
    source = dataclasses.replace(source, load_target=lambda *a: events.append("target") or load(*a))
    over = {"data.seq_len": 128, "num_anchors": 8, "max_steps": 1, "compile": compile}
    drafter = {"drafter.num_layers": 1, "drafter.num_taps": 2, "drafter.mask_token_id": 511}
    cfg = resolve_config("default", **over, **drafter)
    trainer = build_module.build(run_config(cfg, target="shape:tiny", data="-", out=_UNUSED_OUT), source)
    trainer.close()
    assert events == (["workers", "target"] if compile else ["target"])
