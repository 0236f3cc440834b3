"""A target sharded with FSDP2 over 2 and 4 gloo ranks (`--target-parallel fsdp:N`) gives the features of
the whole target, holds 1/N of its layers per rank, trains the same loss curve, and resumes runs of
another target parallelism."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from families import build
from flashdraft.distributed.layout import Layout, TargetParallel
from test_distributed import CONFIG, _assert_same, _resume_from, _train

pytestmark = pytest.mark.slow

# Qwen3-MoE's checkpoint holds one tensor per expert, which the model fuses into one per layer;
# gpt-oss's holds the fused tensors
FAMILIES = ("qwen3", "llama", "gemma3_text", "qwen3_moe", "gpt_oss")

FEATURES = """
import glob, json, os, sys, torch
from flashdraft.distributed.sharded_target import load_sharded_target, resident_bytes
from flashdraft.distributed.topology import init_topology
from flashdraft.model.target import Target, choose_packing, load_target

out, dirs = sys.argv[1], sys.argv[2:]
topo = init_topology(device="cpu", target_parallel="fsdp:" + os.environ["WORLD_SIZE"])
report = {}
for path in dirs:
    whole, _ = load_target(path, "cpu", layers=4)
    sharded, _ = load_sharded_target(path, topo, layers=4)
    taps = [1, 3]
    packing = choose_packing(whole, taps)
    assert choose_packing(sharded, taps) == packing
    vocab = whole.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(topo.rank)  # each rank its own rows, as in training
    ids = torch.randint(0, vocab, (2, 48), generator=g)
    positions = torch.cat([torch.arange(20), torch.arange(28)]).repeat(2, 1)  # two documents a row
    a = Target(whole, taps, packing).features(ids, positions)
    b = Target(sharded, taps, packing).features(ids, positions)
    again = Target(sharded, taps, packing).features(ids, positions)
    diffs = [float((a - b).abs().max()), float((b - again).abs().max())]
    report[path] = {"diff": diffs, "scale": float(a.abs().max()), "bytes": resident_bytes(sharded),
                    "whole": resident_bytes(whole)}
reports = topo.gather_objects(report)
if topo.rank == 0:
    json.dump(reports, open(out, "w"))
del whole, sharded  # the sharded model holds the target group: released before the groups are destroyed
topo.close()
# gloo threads left running after close are destroyed unjoined at teardown, which aborts now and then
threads = [open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm")]
json.dump([name for name in threads if "gloo" in name], open(f"{out}.threads{topo.rank}", "w"))
"""


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_tokenizer):
    dirs, tok = {}, tiny_tokenizer
    for name in FAMILIES:
        path = tmp_path_factory.mktemp(name)
        build(name, len(tok), tok.eos_token_id, tok.pad_token_id).save_pretrained(path)
        tok.save_pretrained(path)
        dirs[name] = path
    return dirs


def _features_on(ranks: int, tmp_path, dirs: list) -> list[dict]:
    script, out = tmp_path / "features.py", tmp_path / f"features_{ranks}.json"
    script.write_text(FEATURES)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(script), str(out), *map(str, dirs)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(ranks):  # Topology.close released every process group
        assert json.loads(Path(f"{out}.threads{rank}").read_text()) == [], rank
    return json.loads(out.read_text())


@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_features_equal_the_whole_targets_and_each_rank_holds_a_shard(ranks, tmp_path, family_dirs):
    reports = _features_on(ranks, tmp_path, list(family_dirs.values()))
    for name, path in family_dirs.items():
        per_rank = [r[str(path)] for r in reports]
        for rank, r in enumerate(per_rank):
            # the same fp32 CPU kernels on the gathered weights: equal to rounding (exactly, as measured)
            assert r["diff"][0] <= 1e-6 * max(1.0, r["scale"]), (name, rank, r["diff"])
            assert r["diff"][1] == 0, (name, rank)  # a second forward (after the first resharded) agrees
            assert r["bytes"]["layers"] == r["whole"]["layers"]  # the same 4 layers, counted globally
            assert r["bytes"]["rest"] == r["whole"]["rest"]  # embedding, lm_head, norms: whole everywhere
        held = [r["bytes"]["layers_held"] for r in per_rank]
        assert sum(held) == per_rank[0]["whole"]["layers"], name  # the shards partition the layers
        assert max(held) <= per_rank[0]["whole"]["layers"] / ranks * 1.25, (name, held)  # about 1/N each


def test_a_sharded_run_trains_as_a_whole_target_run_and_resumes_across_target_parallelism(
    tmp_path, tiny_target_dir
):
    from flashdraft.data.packing import save_token_dataset
    from helpers import random_docs

    data = tmp_path / "data"
    save_token_dataset(random_docs([70, 90, 120, 60, 100, 80] * 4, seed=3, prompt_len=10), data)
    whole = _train(tmp_path, tiny_target_dir, data, "whole", 2, "--nproc", "2")
    sharded = _train(
        tmp_path, tiny_target_dir, data, "sharded", 2, "--nproc", "2", "--target-parallel", "fsdp:2"
    )
    assert "target parallelism fsdp:2: this rank holds" in sharded.stdout
    _assert_same(sharded, whole)
    split = _train(
        tmp_path, tiny_target_dir, data, "split", 2, "--nproc", "4", "--layout", "split:2:2",
        "--target-parallel", "fsdp:2",
    )  # fmt: skip
    _assert_same(split, whole)
    out = _resume_from(tmp_path, whole, "resumed")  # a checkpoint holds nothing of the target's sharding
    resumed = _train(
        tmp_path, tiny_target_dir, data, "resumed", 2, "--nproc", "2", "--target-parallel", "fsdp:2",
        "--resume", str(out),
    )  # fmt: skip
    _assert_same(resumed, whole)


def test_target_groups_are_consecutive_target_ranks_and_must_divide_them():
    assert TargetParallel.parse("fsdp:2").groups(Layout().on(4)) == [[0, 1], [2, 3]]
    assert TargetParallel.parse("fsdp:2").groups(Layout.parse("split:4:3").on(7)) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="3 target rank"):
        TargetParallel.parse("fsdp:2").groups(Layout().on(3))
    for bad in ("fsdp", "tp:2", "fsdp:0"):
        with pytest.raises(ValueError, match="expected 'none' or 'fsdp:N'"):
            TargetParallel.parse(bad)


def test_what_a_sharded_target_cannot_do_is_refused(tmp_path, tiny_target_dir):
    from typer.testing import CliRunner

    from flashdraft.cli.main import app

    args = ["train", "--target", str(tiny_target_dir), "--data", str(tmp_path), "--out", str(tmp_path / "r")]
    result = CliRunner().invoke(
        app, [*args, "--target-parallel", "fsdp:2", "--eval-every", "2", "--eval-prompts", "p.jsonl"]
    )
    assert result.exit_code == 2 and "drop eval_every with target_parallel" in result.output
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG % 1)
    cmd = [sys.executable, "-m", "flashdraft.cli.main", "train", "--target", str(tiny_target_dir), "--data",
           str(tmp_path), "--out", str(tmp_path / "r"), "--config", str(cfg),
           "--target-parallel", "fsdp:2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # one process: no group of 2
    assert proc.returncode == 2 and "do not split into groups of 2" in proc.stderr


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_with_its_keys(tmp_path, tiny_target_dir):
    """Sharded loading reads weights by the model's names: a renamed or reshaped weight is an error."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from flashdraft.distributed.sharded_target import _state_to_load
    from flashdraft.distributed.topology import Topology
    from flashdraft.model.target import load_target

    broken = tmp_path / "broken"
    shutil.copytree(tiny_target_dir, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.0.mlp.up.weight"] = weights.pop("model.layers.0.mlp.up_proj.weight")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_target(tiny_target_dir, "cpu")

    stored = dcp.HuggingFaceStorageReader(str(broken)).read_metadata().state_dict_metadata
    with pytest.raises(
        ValueError, match=r"missing from the checkpoint: model\.layers\.0\.mlp\.up_proj\.weight"
    ):
        _state_to_load(model, stored, broken, partial=False)
    with pytest.warns(UserWarning, match=r"does not use: model\.layers\.0\.mlp\.up\.weight"):
        stored_ok = dict(stored)
        stored_ok["model.layers.0.mlp.up_proj.weight"] = stored_ok["model.layers.0.mlp.up.weight"]
        _state_to_load(model, stored_ok, broken, partial=False)
    from flashdraft.distributed.sharded_target import load_sharded_target

    with pytest.raises(ValueError, match="needs a target group"):
        load_sharded_target(tiny_target_dir, Topology())
    with pytest.raises(ValueError, match="a GGUF file or a hub id is not"):
        load_sharded_target(tmp_path / "model.gguf", Topology())


def test_a_split_layout_whose_target_ranks_serve_unequal_counts_is_refused():
    from flashdraft.config import resolve_config
    from flashdraft.distributed.topology import Topology
    from flashdraft.train.build import check_sharded_fits

    topo = Topology(layout=Layout.parse("split:2:1").on(3), target_parallel=TargetParallel(2))
    with pytest.raises(ValueError, match="3 micro-batches .* do not divide evenly over the 2 target ranks"):
        check_sharded_fits(resolve_config("tiny_cpu", grad_accum=3), topo)
    check_sharded_fits(resolve_config("tiny_cpu", grad_accum=4), topo)  # 2 each


def test_plan_shows_a_sharded_targets_memory_and_all_gather(tmp_path):
    from typer.testing import CliRunner

    from flashdraft.bench import shape_config
    from flashdraft.cli.main import app

    shape_config("llama3-70b").save_pretrained(tmp_path / "llama3-70b")  # config only, no weights
    args = [
        "train",
        "--target",
        str(tmp_path / "llama3-70b"),
        "--data",
        "-",
        "--out",
        "-",
        "--plan",
        "--nproc",
        "8",
    ]
    layers = lambda text: float(re.search(r"target layers ([\d.]+)", text).group(1))  # noqa: E731
    whole = CliRunner().invoke(app, [*args, "--preset", "qwen3_8b_h200"])
    sharded = CliRunner().invoke(app, [*args, "--preset", "qwen3_8b_h200", "--target-parallel", "fsdp:8"])
    assert whole.exit_code == 0 and sharded.exit_code == 0, sharded.output
    layer_gib = 2 * (8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672) / 2**30  # one Llama-3.1-70B layer
    assert layers(sharded.output) == pytest.approx(layers(whole.output) / 8 + 2 * layer_gib, abs=0.05)
    assert "GB all-gathered per micro-batch" in sharded.output and "all-gathered" not in whole.output
    refused = CliRunner().invoke(app, [*args, "--preset", "qwen3_8b_h200", "--target-parallel", "fsdp:3"])
    assert refused.exit_code != 0 and "do not split into groups of 3" in refused.output
