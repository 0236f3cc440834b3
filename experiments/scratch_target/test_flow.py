"""The scratch-target proof's flow at smoke scale on the CPU, so that it keeps working between GPU runs."""

import dataclasses
import json
from pathlib import Path

import pytest

from experiments.scratch_target.flow import (
    H200,
    SMOKE,
    VARIANTS,
    drafter_steps,
    run_proof,
    with_drafter_overrides,
    with_scale_overrides,
)
from flashdraft.eval.spec import mean_tau

pytestmark = pytest.mark.slow


def test_the_proof_runs_every_stage_and_the_reference_package_agrees(tmp_path):
    pytest.importorskip("dflash.model", reason="reference package: pip install --no-deps dflash==0.1.0")
    # the evals on the fixed-shape caches (no graphs on a CPU): the reference must still agree
    run_proof(tmp_path, 1.0, dataclasses.replace(SMOKE, cuda_graphs=True), ablations=True)
    s = json.loads((tmp_path / "proof.json").read_text())
    assert set(s["drafters"]) == set(VARIANTS)
    for name, d in s["drafters"].items():
        assert d["steps"] == s["drafter_steps"] >= 50 and 1.0 <= d["tau_train"] <= 16.0
        # every drafter measured on the held-out conversations, the last time at its last step
        assert d["val_during_training"][-1][0] == d["steps"] and 1.0 <= d["val_tau_train"] <= 16.0
        assert name == "main" or 1.0 <= d["tau"] <= 16.0
    # the drafter's prompts come from source files the target never trained on, the eval's from others
    sources = {k: set(v) for k, v in json.loads((tmp_path / "sources.json").read_text()).items()}
    assert all(sources.values()) and not (sources["prompts"] | sources["eval"]) & sources["target"]
    assert not sources["prompts"] & sources["eval"]
    with open(tmp_path / "data" / "conversations.jsonl") as f:
        origins = {json.loads(line)["id"].rsplit("#", 1)[0] for line in f}
    assert len(origins) > 1 and origins <= sources["prompts"] | {f"val:{f}" for f in sources["eval"]}
    # validation: windows of the eval's files, none of them an eval prompt, none of them trained on
    lines = lambda path: [json.loads(x) for x in path.read_text().splitlines()]  # noqa: E731
    val = lines(tmp_path / "val" / "regenerated.jsonl")
    # a tiny target can answer a prompt with nothing: regeneration keeps and counts those apart
    failed = [r["id"] for r in lines(tmp_path / "data" / "regenerated.jsonl.failed.jsonl")]
    val_failed = [i for i in failed if i.startswith("val:")]
    assert len(val) + len(val_failed) == SMOKE.val_conversations and 0 < s["val_conversations"] <= len(val)
    assert {r["id"].split("#")[0][4:] for r in val} <= sources["eval"]
    eval_prompts = {r["messages"][0]["content"] for r in lines(tmp_path / "eval" / "prompts.jsonl")}
    assert not eval_prompts & {r["messages"][0]["content"] for r in val}
    trained = [r["id"] for r in lines(tmp_path / "data" / "regenerated.rest.jsonl")]
    assert len(trained) + len(failed) - len(val_failed) == SMOKE.conversations - SMOKE.val_conversations
    assert s["conversations"] <= len(trained)
    assert not any(i.startswith("val:") for i in trained)
    ablation = Path(s["drafters"]["no_target_features"]["checkpoint"])
    config = json.loads((ablation / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [-1]
    for key in ("tau_T0", "tau_T1", "tau_ngram_T0", "tau_ngram_T1"):
        assert 1.0 <= s[key] <= 16.0
    ratio = s["tau_ratio_T0"]
    assert ratio["ratio"] == pytest.approx(s["tau_T0"] / s["tau_ngram_T0"], rel=1e-4)
    assert ratio["ci95"][0] <= ratio["ratio"] <= ratio["ci95"][1]
    # fp32 on the CPU: the reference decodes our export with our acceptance lengths, sample by sample,
    # on the first probe_prompts of the eval prompts
    probe = SMOKE.probe_prompts
    assert s["probe_prompts"] == probe < SMOKE.eval_prompts
    report = json.loads((tmp_path / "eval" / "report_T0.json").read_text())
    assert s["tau_T0_probe_prompts"] == pytest.approx(mean_tau(report["dflash"]["tau_per_sample"][:probe]))
    assert s["reference"]["samples_with_our_tau"] == probe
    assert s["reference"]["tau"] == pytest.approx(s["tau_T0_probe_prompts"])
    # tau during training on the same prompts, at the last step: the eval's figure on them
    step, tau = s["drafters"]["main"]["tau_during_training"][-1]
    assert step == s["drafters"]["main"]["steps"] and tau == pytest.approx(s["tau_T0_probe_prompts"], rel=0.1)
    assert set(s["seconds"]) >= {"target_s", "drafters_s", "eval_T0_s", "reference_s", "eval_T1_s"}
    # the ablations trained with the main drafter, in its lap, not after it
    assert s["seconds"]["drafters_s"] > 0 and "ablation_drafters_s" not in s["seconds"]
    assert s["main_flow_s"] < s["wall_s"]

    # a run killed after its drafters: --resume trains nothing again and measures what is missing
    with pytest.raises(FileExistsError, match="--resume"):
        run_proof(tmp_path, 1.0, SMOKE)
    dropped = ("tau_T1", "reference", "tau_T0_probe_prompts")
    cut = json.loads(json.dumps({k: v for k, v in s.items() if k not in dropped}))
    cut["drafters"]["taps_3"].pop("tau")
    (tmp_path / "proof.json").write_text(json.dumps(cut))
    # prompts past the probe ones must not count in the probe figures (a tiny target gives every
    # prompt the same tau, so the report is edited to tell them apart)
    report["dflash"]["tau_per_sample"][probe:] = [16.0] * (SMOKE.eval_prompts - probe)
    (tmp_path / "eval" / "report_T0.json").write_text(json.dumps(report))
    trained = {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/checkpoints/*/model.safetensors")}
    again = run_proof(tmp_path, 1.0, SMOKE, ablations=True, resume=True)
    assert {
        p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/checkpoints/*/model.safetensors")
    } == trained
    assert again["tau_T1"] == pytest.approx(s["tau_T1"])  # same seed, same drafter: same samples
    assert again["drafters"]["taps_3"]["tau"] == s["drafters"]["taps_3"]["tau"]
    assert again["reference"]["samples_with_our_tau"] == probe
    assert again["tau_T0_probe_prompts"] == pytest.approx(s["tau_T0_probe_prompts"])


def test_the_drafter_budget_leaves_room_for_the_evals():
    # 306 s left after the data stages: the drafter's steps leave the evals their time
    steps = drafter_steps(306, H200)
    assert H200.drafter_startup_s + steps * H200.drafter_step_s + H200.proof_eval_s <= 306
    assert drafter_steps(306 + 10 * H200.drafter_step_s, H200) == steps + 10
    assert drafter_steps(0, H200) == 50


def test_drafter_overrides_change_the_config_and_the_plan_or_fail_by_name():
    scale = with_drafter_overrides(H200, ["drafter.num_layers=5", "data.rows_per_batch = 16"], step_ms=40)
    assert scale.drafter["drafter.num_layers"] == 5 and scale.drafter["data.rows_per_batch"] == 16
    assert scale.drafter["drafter.num_taps"] == H200.drafter["drafter.num_taps"]  # the rest kept
    assert scale.drafter_step_s == 0.04 and H200.drafter["drafter.num_layers"] == 3
    assert with_drafter_overrides(H200, []).drafter_step_s == H200.drafter_step_s
    with pytest.raises(ValueError, match="KEY=VALUE"):
        with_drafter_overrides(H200, ["drafter.num_layers"])
    with pytest.raises(ValueError, match="num_layerz"):
        with_drafter_overrides(H200, ["drafter.num_layerz=5"])


def test_scale_overrides_change_plain_fields_or_fail_by_name():
    scale = with_scale_overrides(H200, ["conversations=131072", "regen_batch = 16384", "proof_eval_s=60"])
    assert (scale.conversations, scale.regen_batch, scale.proof_eval_s) == (131072, 16384, 60.0)
    assert scale.drafter == H200.drafter and H200.conversations == 98304  # the rest kept, H200 untouched
    assert with_scale_overrides(H200, ["cuda_graphs=false"]).cuda_graphs is False
    for bad, message in [
        ("conversation=1", "KEY one of"),
        ("drafter=3", "KEY one of"),  # the drafter's config has its own option
        ("conversations", "KEY=VALUE"),
        ("conversations=1.5", "not a int"),
        ("cuda_graphs=3", "not a bool"),
    ]:
        with pytest.raises(ValueError, match=message):
            with_scale_overrides(H200, [bad])


def test_a_drafter_runs_throughput_is_its_median_interval_not_the_last(tmp_path):
    import subprocess
    import sys

    from experiments.scratch_target.flow import DrafterRun, finish_drafter
    from flashdraft.model.checkpoint import LATEST

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / LATEST).write_text("step_000003\n")
    # the last interval holds the final tau probe: ten times slower
    rows = [
        dict(step=s, loss=1.0, acc_slot1=0.5, tau_train=2.0, ctx_tok_s=t)
        for s, t in [(1, 9.0), (2, 11.0), (3, 1.0)]
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    process = subprocess.Popen([sys.executable, "-c", ""])
    result = finish_drafter(DrafterRun("main", tmp_path, process, tmp_path / "main.log"))
    assert result["ctx_tok_s"] == 9.0 and result["steps"] == 3
    assert result["checkpoint"] == str(tmp_path / "checkpoints" / "step_000003")


def test_ablations_are_planned_into_the_same_budget():
    main_only, with_ablations = drafter_steps(500, H200), drafter_steps(500, H200, ablations=True)
    spent = H200.drafter_startup_s + H200.proof_eval_s + H200.ablation_eval_s  # one start-up for all
    assert spent + with_ablations * (H200.drafter_step_s + H200.ablation_step_s) <= 500
    assert 50 < with_ablations < main_only


def test_prompt_windows_overlap_by_their_stride():
    from flashdraft.demo.pipeline import code_windows

    class Chars:  # one token per character
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[ord(c) for c in t] for t in texts]}

        def batch_decode(self, windows):
            return ["".join(map(chr, w)) for w in windows]

    text = "abcdefghij"
    back_to_back = code_windows([text], Chars(), 2, 2)
    assert [w["prompt"] + "|" + w["response"] for w in back_to_back] == ["ab|cd", "ef|gh"]
    overlapping = code_windows([text, "xyz"], Chars(), 2, 2, stride=3)
    assert [w["prompt"] + "|" + w["response"] for w in overlapping] == ["ab|cd", "de|fg", "gh|ij"]
    assert [w["text"] for w in overlapping] == [0, 0, 0]  # "xyz" is shorter than a window
