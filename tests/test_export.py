"""`flashdraft export`: the z-lab layout exactly as engines load it, and vLLM's speculators layout with the
field names and aux-layer numbering vLLM reads (checked against speculators 0.9.0's own DFlash converter)."""

import json

import pytest
import torch
import typer
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from flashdraft.cli.eval import export_cmd
from flashdraft.export.formats import export_checkpoint
from flashdraft.model.checkpoint import load_drafter, write_zlab
from flashdraft.model.drafter import DFlashDrafter, drafter_config
from flashdraft.train.build import init_drafter_
from helpers import BLOCK, MASK_ID, VOCAB, tiny_drafter, tiny_target

# Keys of the config.json that speculators 0.9.0 writes for a converted z-lab DFlash checkpoint
# (`DFlashConverter().convert(...)`), less `auto_map`, which points at a config.py for
# trust_remote_code that vLLM does not read.
SPECULATORS_KEYS = {
    "architectures",
    "aux_hidden_state_layer_ids",
    "block_size",
    "draft_vocab_size",
    "dtype",
    "mask_token_id",
    "sample_from_anchor",
    "sliding_window_non_causal",
    "speculators_config",
    "speculators_model_type",
    "speculators_version",
    "target_hidden_size",
    "tie_word_embeddings",
    "transformer_layer_config",
    "transformers_version",
}
PROPOSAL_KEYS = {"accept_tolerance", "proposal_type", "speculative_tokens", "verifier_accept_k"}


@pytest.fixture
def ckpt(tmp_path):
    """A training checkpoint directory: fp32 weights plus files an engine must not get."""
    drafter = tiny_drafter(tiny_target())
    path = tmp_path / "run" / "checkpoints" / "step_000010"
    path.mkdir(parents=True)
    write_zlab(drafter, path, dtype=torch.float32)
    (path / "trainer_state.pt").write_bytes(b"optimizer")
    (path / "env.json").write_text("{}")
    return path


def test_zlab_export_is_config_and_bf16_weights_only(ckpt, tmp_path):
    out = export_checkpoint(ckpt, "zlab", tmp_path / "zlab")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    source, exported = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name], tensor.to(torch.bfloat16))
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((ckpt / "config.json").read_text()) | {"torch_dtype": "bfloat16"}
    reloaded = load_drafter(out)
    assert reloaded.target_layer_ids == config["dflash_config"]["target_layer_ids"]


def _edit_config(ckpt, edit) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    edit(config)
    (ckpt / "config.json").write_text(json.dumps(config))


def _edit_weights(ckpt, edit) -> None:
    weights = load_file(str(ckpt / "model.safetensors"))
    edit(weights)
    save_file(weights, str(ckpt / "model.safetensors"))


BROKEN = {
    "unexpected tensor embed_tokens.weight": lambda c: _edit_weights(
        c, lambda w: w.update({"embed_tokens.weight": torch.zeros(VOCAB, 32)})
    ),
    "missing tensor layers.1.mlp.up_proj.weight": lambda c: _edit_weights(
        c, lambda w: w.pop("layers.1.mlp.up_proj.weight")
    ),
    "fc.weight has shape (32, 32)": lambda c: _edit_weights(
        c, lambda w: w.update({"fc.weight": torch.zeros(32, 32)})
    ),
    "missing dflash_config": lambda c: _edit_config(c, lambda cfg: cfg.pop("dflash_config")),
    "missing num_target_layers": lambda c: _edit_config(c, lambda cfg: cfg.pop("num_target_layers")),
    "architectures must be": lambda c: _edit_config(
        c, lambda cfg: cfg.update(architectures=["Qwen3ForCausalLM"])
    ),
    "mask_token_id 96 is not a row": lambda c: _edit_config(
        c, lambda cfg: cfg["dflash_config"].update(mask_token_id=96)
    ),
    "outside the target's 6 layers": lambda c: _edit_config(
        c, lambda cfg: cfg["dflash_config"].update(target_layer_ids=[1, 6])
    ),
    "block_size (top level and dflash_config)": lambda c: _edit_config(
        c, lambda cfg: cfg.update(block_size=4)
    ),
}


@pytest.mark.parametrize("problem", list(BROKEN))
def test_export_rejects_a_checkpoint_engines_would_not_load(ckpt, tmp_path, problem):
    BROKEN[problem](ckpt)
    with pytest.raises(ValueError) as e:
        export_checkpoint(ckpt, "zlab", tmp_path / "out")
    assert problem in str(e.value)
    assert not (tmp_path / "out").exists()


def test_speculators_export_has_the_fields_and_layer_numbering_vllm_reads(ckpt, tmp_path):
    target = tmp_path / "target"
    tiny_target().save_pretrained(target)
    out = export_checkpoint(ckpt, "speculators", tmp_path / "spec", verifier=str(target))
    config = json.loads((out / "config.json").read_text())
    zlab = json.loads((ckpt / "config.json").read_text())
    ids = zlab["dflash_config"]["target_layer_ids"]

    assert set(config) == SPECULATORS_KEYS
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in ids]  # numbered from the embedding output
    assert [i - 1 for i in config["aux_hidden_state_layer_ids"]] == ids  # vLLM's update_dflash maps them back
    assert config["mask_token_id"] == MASK_ID
    assert config["draft_vocab_size"] == VOCAB and config["block_size"] == BLOCK
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert set(spec["proposal_methods"][0]) == PROPOSAL_KEYS
    assert spec["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    assert spec["verifier"] == {"name_or_path": str(target), "architectures": ["Qwen3ForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == zlab["num_hidden_layers"]
    assert layer["hidden_size"] == zlab["hidden_size"] and layer["vocab_size"] == VOCAB
    assert layer["rope_parameters"]["rope_theta"] == zlab["rope_theta"]
    assert not {"dflash_config", "block_size", "num_target_layers", "architectures"} & set(layer)
    weights, source = load_file(str(out / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    assert weights.keys() == source.keys()  # the z-lab names: speculators saves no embedding/lm_head for them
    assert all(torch.equal(weights[k], source[k].to(torch.bfloat16)) for k in source)


def test_a_tap_on_the_targets_last_layer_is_refused_by_the_config_and_both_exports(tmp_path):
    """Loaders disagree on what the last layer's output is (the reference reads the final-normed state,
    SGLang never captures it), so no drafter tapping it is built or exported."""
    model = tiny_target()
    with pytest.raises(ValueError, match="last layer"):
        drafter_config(model.config, 1, [2, 5], 2, BLOCK, MASK_ID)
    drafter = DFlashDrafter(drafter_config(model.config, 1, [2, 4], 2, BLOCK, MASK_ID))
    init_drafter_(drafter, 0.02, seed=0)
    write_zlab(drafter, tmp_path)
    export_checkpoint(tmp_path, "zlab", tmp_path / "ok")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [2, 5]  # as a checkpoint written elsewhere may say
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for fmt, out in (("zlab", "zlab"), ("speculators", "spec")):
        with pytest.raises(ValueError, match="last layer"):
            export_checkpoint(tmp_path, fmt, tmp_path / out, verifier="some/target")


def test_zlab_export_names_the_taps_for_older_vllm_too(tmp_path):
    """eagle_aux_hidden_state_layer_ids: the z-lab ids numbered from the embedding output (id + 1)."""
    model = tiny_target()
    drafter = DFlashDrafter(drafter_config(model.config, 1, [1, 3], 2, BLOCK, MASK_ID))
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter, tmp_path / "ckpt")
    for cfg in (
        json.loads((tmp_path / "ckpt" / "config.json").read_text()),
        json.loads(
            (export_checkpoint(tmp_path / "ckpt", "zlab", tmp_path / "zlab") / "config.json").read_text()
        ),
    ):
        assert cfg["dflash_config"]["target_layer_ids"] == [1, 3]
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4]


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("export")(export_cmd)
    app.command("noop")(lambda: None)  # a second command keeps `export` a subcommand
    return app


def test_export_cli_takes_the_speculators_verifier_from_the_run_config(ckpt, tmp_path):
    (ckpt.parent.parent / "config.yaml").write_text(yaml.safe_dump({"target": "Qwen/Qwen3-8B"}))
    result = CliRunner().invoke(
        _cli(), ["export", str(ckpt), "--format", "speculators", "--out", str(tmp_path / "s")]
    )
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen3-8B", "architectures": []}


def test_export_cli_reports_bad_requests(ckpt, tmp_path):
    runner, app = CliRunner(), _cli()
    result = runner.invoke(app, ["export", str(ckpt), "--format", "onnx", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and "unknown format 'onnx'" in result.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    result = runner.invoke(app, ["export", str(ckpt), "--out", str(tmp_path / "full")])
    assert result.exit_code == 2 and "not empty" in result.output
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    result = runner.invoke(app, ["export", str(ckpt), "--format", "zlab", "--out", str(tmp_path / "z")])
    assert result.exit_code == 0 and (tmp_path / "z" / "model.safetensors").is_file()
