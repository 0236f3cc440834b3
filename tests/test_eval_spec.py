"""The speculative-decoding engine: greedy output is the target's own, tau counts what it should,
eval_tau is cheap and safe to call from training, and `flashdraft eval` writes its report."""

import json
import re
from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch
import typer
from typer.testing import CliRunner

from flashdraft.cli.eval import eval_cmd
from flashdraft.data.packing import collate_rows
from flashdraft.eval.ngram import NgramProposer, lookup
from flashdraft.eval.report import acceptance_by_position, build_report, method_summary
from flashdraft.eval.spec import (
    DFlashProposer,
    Generation,
    StopText,
    chat_messages,
    decoding_target,
    encode_prompt,
    eval_tau,
    generate,
    read_prompts,
    run_methods,
)
from flashdraft.model.checkpoint import write_zlab
from flashdraft.model.drafter import DFlashDrafter, drafter_config
from flashdraft.model.target import Target
from flashdraft.train.blocks import walk_lengths
from flashdraft.train.build import init_drafter_
from flashdraft.train.step import Kernels, acceptance_map, micro_step_loss, plan_micro_batch, target_features
from helpers import BLOCK, GAMMA, VOCAB, tiny_drafter, tiny_target

NEW_TOKENS = 40


@lru_cache(maxsize=1)
def tiny_setup() -> SimpleNamespace:
    """A tiny target with peaked logits, an untrained drafter, and a drafter trained (a few seconds) on the
    target's greedy continuations of `prompts`, so that on those prompts most drafts are accepted."""
    model = tiny_target()
    # a random lm_head at init scale gives near-flat distributions; a trained one doesn't
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    untrained = tiny_drafter(model, seed=0)
    trained = tiny_drafter(model, seed=0)
    target = Target(model, trained.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (10,), generator=g).tolist() for _ in range(6)]
    train_on_continuations(trained, target, prompts)
    return SimpleNamespace(model=model, target=target, untrained=untrained, trained=trained, prompts=prompts)


def train_on_continuations(drafter: DFlashDrafter, target: Target, prompts: list[list[int]], steps: int = 80):
    """Fit `drafter` to the target's greedy continuations of `prompts` (a few seconds on CPU)."""
    docs = []
    for p in prompts:
        out = generate(target, torch.tensor([p]), 70).tokens
        docs.append({"input_ids": p + out, "loss_mask": [0] * len(p) + [1] * len(out)})
    batch = collate_rows([[d] for d in docs], 80, pad_token_id=0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    anchors = torch.Generator().manual_seed(1)
    drafter.train()
    for _ in range(steps):
        mb = plan_micro_batch(batch, 24, drafter.block_size, drafter.mask_token_id, GAMMA, anchors)
        out = micro_step_loss(drafter, target, mb, Kernels("dense"))
        (out.weighted_ce / mb.blocks.weights.sum()).backward()
        opt.step()
        opt.zero_grad()
    drafter.eval()


def _proposer(kind: str, s: SimpleNamespace):
    return NgramProposer() if kind == "ngram" else DFlashProposer(getattr(s, kind), s.target)


@pytest.mark.parametrize("kind", ["trained", "untrained", "ngram"])
def test_greedy_speculative_output_is_the_targets_greedy_output(kind):
    s = tiny_setup()
    accepted_drafts = 0
    for p in s.prompts[:4]:
        ids = torch.tensor([p])
        hf = s.model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        spec = generate(s.target, ids, NEW_TOKENS, _proposer(kind, s), BLOCK)
        assert spec.tokens == hf[0, len(p) :].tolist()
        assert generate(s.target, ids, NEW_TOKENS).tokens == spec.tokens  # the autoregressive baseline too
        accepted_drafts += sum(a - 1 for a in spec.accept_lengths)
    if kind != "untrained":  # the accepting path ran, not only the rejecting one
        assert accepted_drafts > NEW_TOKENS


def _decoded(s: SimpleNamespace, prompt: list[int]):
    """Greedy DFlash decoding of `prompt` with the trained drafter, and the prompt and answer as a training
    document (the answer in the loss) in a batch of one row."""
    spec = generate(s.target, torch.tensor([prompt]), NEW_TOKENS, DFlashProposer(s.trained, s.target), BLOCK)
    doc = {"input_ids": prompt + spec.tokens, "loss_mask": [0] * len(prompt) + [1] * len(spec.tokens)}
    return spec, doc, collate_rows([[doc]], len(doc["input_ids"]), pad_token_id=0)


def test_training_blocks_at_the_cycles_of_decoding_accept_what_decoding_accepted():
    """What training computes is what serving computes: on a greedily decoded answer, teacher-forced
    blocks (one target forward over the whole sequence, training's block form) walked from the answer's
    first token give every cycle's acceptance length, as validation's val_tau_walk reads them."""
    s = tiny_setup()
    cycles = 0
    for p in s.prompts:
        spec, doc, batch = _decoded(s, p)
        with torch.no_grad():
            accepted = acceptance_map(
                s.trained, s.target, batch, target_features(s.target, batch), 8, GAMMA, Kernels("dense")
            )
        [walk] = walk_lengths(accepted, batch.loss_mask, batch.doc_ids)
        # the walk stops where a whole block no longer fits, where decoding shrinks its blocks; decoding's
        # last cycle also stops at the token budget
        last = len(spec.accept_lengths) - 1
        assert walk[:last] == spec.accept_lengths[: min(len(walk), last)]
        assert len(walk) <= last or walk[last] >= spec.accept_lengths[last]
        assert len(p) + sum(walk) > len(doc["input_ids"]) - BLOCK
        cycles += len(walk)
    assert cycles < len(s.prompts) * NEW_TOKENS / 3  # the drafter was accepted: long cycles were compared


def test_trained_drafter_is_accepted_and_untrained_is_not():
    s = tiny_setup()
    trained = eval_tau(s.target, None, s.trained, s.prompts, max_new_tokens=48)
    untrained = eval_tau(s.target, None, s.untrained, s.prompts, max_new_tokens=48)
    assert trained > 4.0, trained
    assert untrained < 1.5, untrained


@pytest.mark.parametrize("budget", [1, 2, 9, 33])
def test_token_budget_is_met_exactly_and_blocks_shrink_to_it(budget):
    s = tiny_setup()
    ids = torch.tensor([s.prompts[0]])
    out = generate(s.target, ids, budget, DFlashProposer(s.trained, s.target), BLOCK)
    assert len(out.tokens) == budget
    assert sum(out.accept_lengths) == budget - 1  # every token after the first comes from a cycle
    left = budget - 1
    for verified, kept in zip(out.verify_sizes, out.accept_lengths, strict=True):
        assert 1 <= kept <= verified <= min(BLOCK, left + 1)
        left -= kept


def test_stop_token_ends_generation_and_is_kept():
    s = tiny_setup()
    ids = torch.tensor([s.prompts[1]])
    plain = generate(s.target, ids, NEW_TOKENS).tokens
    stop = next(t for i, t in enumerate(plain) if i >= 12 and t not in plain[:i])  # first seen late
    out = generate(
        s.target, ids, NEW_TOKENS, DFlashProposer(s.trained, s.target), BLOCK, stop_token_ids=[stop]
    )
    assert out.tokens == plain[: plain.index(stop) + 1]
    assert sum(out.accept_lengths) == len(out.tokens) - 1
    assert out.verify_sizes[-1] > out.accept_lengths[-1]  # the stop cut a cycle short


@pytest.mark.parametrize("kind", ["trained", "ngram", None])
def test_a_stop_string_ends_generation_at_the_token_that_completes_it(kind):
    """As a completions API's stop: the new text is searched (a stop string across two tokens here), the
    token that completes it is kept, and every method ends at the same token."""
    s = tiny_setup()
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(f"[{t}]" for t in ids))
    ids = torch.tensor([s.prompts[2]])
    plain = generate(s.target, ids, NEW_TOKENS).tokens
    pairs = list(zip(plain, plain[1:], strict=False))
    i = next(i for i in range(14, len(pairs)) if pairs[i] not in pairs[:i])  # a pair first seen late
    stop = StopText(tokenizer, [f"[{plain[i]}][{plain[i + 1]}]", "never"])
    proposer = _proposer(kind, s) if kind else None
    out = generate(s.target, ids, NEW_TOKENS, proposer, BLOCK, stop_text=stop)
    assert out.tokens == plain[: i + 2]
    assert sum(out.accept_lengths) == len(out.tokens) - 1
    with pytest.raises(ValueError, match="non-empty strings"):
        StopText(tokenizer, [""])


def test_eval_tau_is_the_mean_of_per_sample_tau_and_restores_training_mode():
    s = tiny_setup()
    per_sample = [
        generate(s.target, torch.tensor([p]), 24, DFlashProposer(s.trained, s.target), BLOCK).tau
        for p in s.prompts[:3]
    ]
    s.trained.train()
    try:
        tau = eval_tau(s.model, None, s.trained, s.prompts[:3], max_new_tokens=24)
        assert s.trained.training
    finally:
        s.trained.eval()
    assert tau == pytest.approx(sum(per_sample) / 3)
    # on the fixed-shape caches (the proof's ablations): the same cycles, so the same tau
    graphs = eval_tau(s.model, None, s.trained, s.prompts[:3], max_new_tokens=24, cuda_graphs=True)
    assert graphs == pytest.approx(tau, rel=1e-6)


def test_eval_tau_on_a_bare_model_leaves_it_as_it_was():
    s = tiny_setup()
    modules = [s.model.get_input_embeddings(), *s.model.model.layers]

    def hooks():  # transformers may keep recorders of its own (output_hidden_states): they stay as they are
        return [list(m._forward_hooks) for m in modules]

    before = hooks()
    taus = [eval_tau(s.model, None, s.trained, s.prompts[:1], max_new_tokens=4) for _ in range(2)]
    assert taus[0] == taus[1]
    assert hooks() == before
    target = decoding_target(s.model, s.trained)
    target.features(torch.tensor([[5, 6, 7]]))
    assert hooks() == before and target.model is s.model


def test_eval_tau_refuses_a_target_of_another_depth_than_the_drafters():
    drafter = tiny_drafter(tiny_target())
    shallower = Target(tiny_target(layers=5), drafter.target_layer_ids)
    with pytest.raises(ValueError, match="trained on a target of 6"):
        eval_tau(shallower, None, drafter, [[1, 2, 3]], max_new_tokens=4)


def test_prompt_lookup_copies_the_continuation_of_the_longest_earliest_match():
    seq = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    assert lookup(seq, 3, max_ngram=3) == [3, 9, 1]  # "1 2" first seen at index 1
    assert lookup([8, 1, 2, 6, 2, 1, 2], 2, max_ngram=2) == [6, 2]
    assert lookup([1, 2, 3, 2], 4, max_ngram=2) == [3, 2]  # no bigram match: the unigram "2"
    assert lookup([1, 2, 3], 4) == []
    assert lookup(seq, 0) == []


def test_prompts_are_rendered_for_generation_without_a_trailing_assistant_turn(tmp_path, tiny_tokenizer):
    path = tmp_path / "prompts.jsonl"
    user = {"role": "user", "content": "hello"}
    records = [{"messages": [user, {"role": "assistant", "content": "old answer"}]}, {}, {"prompt": "hello"}]
    path.write_text("\n".join(json.dumps(r) for r in records[::2]) + "\n\n")
    conversations = read_prompts(path)
    assert conversations == [[user], [user]]
    text = tiny_tokenizer.decode(encode_prompt(tiny_tokenizer, conversations[0]))
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="messages"):
        chat_messages(records[1])


def test_report_counts_acceptance_per_cycle_and_per_position():
    gens = [
        Generation(tokens=list(range(9)), accept_lengths=[4, 1, 3], verify_sizes=[4, 4, 4], decode_s=0.8),
        Generation(tokens=list(range(3)), accept_lengths=[2], verify_sizes=[2], decode_s=0.4),
        Generation(tokens=[7]),  # stopped at the first token: no cycle, left out of tau
    ]
    assert acceptance_by_position(gens, 4) == [
        pytest.approx(3 / 4),
        pytest.approx(2 / 3),
        pytest.approx(1 / 3),
    ]
    stats = method_summary(gens, 4)
    assert stats["tau"] == pytest.approx((8 / 3 + 2) / 2)
    assert stats["accept_length_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert stats["time_per_output_token_s"] == pytest.approx((0.8 / 8 + 0.4 / 2) / 2)
    plain = [Generation(tokens=g.tokens, decode_s=2 * g.decode_s) for g in gens]
    report = build_report({"temperature": 0.0}, {"autoregressive": plain, "dflash": gens, "ngram": gens}, 4)
    assert report["speedup"]["dflash"] == pytest.approx(2.0)
    assert report["identical_to_autoregressive"] == {"dflash": 3, "ngram": 3, "of": 3}
    # two samples with a cycle: tau 8/3 and 2; the third is left out of the spread as of the mean
    assert stats["tau_stderr"] == pytest.approx(abs(8 / 3 - 2) / 2)
    assert report["tau_ratio_dflash_over_ngram"] == {"ratio": 1.0, "ci95": [1.0, 1.0], "samples": 2}


def test_tau_is_reported_by_prompt_length():
    """Buckets of prompt tokens (below 256, 256-1023, ... 16K and beyond), each with its prompt count and
    each speculative method's mean tau over its prompts."""
    from flashdraft.eval.report import bucket_name

    assert [bucket_name(n) for n in (0, 255, 256, 4095, 16383, 16384)] == [
        "0-255", "0-255", "256-1023", "1024-4095", "4096-16383", ">=16384",
    ]  # fmt: skip

    def gen(*lengths):
        return Generation([1] * (sum(lengths) + 1), list(lengths), verify_sizes=[4] * len(lengths))

    dflash = [gen(4, 4), gen(2), gen(3, 1), gen(1)]
    ngram = [gen(2), gen(1), gen(1), gen(2)]
    plain = [Generation(tokens=g.tokens) for g in dflash]
    results = {"autoregressive": plain, "dflash": dflash, "ngram": ngram}
    report = build_report({"temperature": 1.0}, results, 4, prompt_lengths=[100, 5000, 120, 300])
    assert report["tau_by_prompt_length"] == {
        "0-255": {"prompts": 2, "dflash": pytest.approx(3.0), "ngram": pytest.approx(1.5)},
        "256-1023": {"prompts": 1, "dflash": pytest.approx(1.0), "ngram": pytest.approx(2.0)},
        "4096-16383": {"prompts": 1, "dflash": pytest.approx(2.0), "ngram": pytest.approx(1.0)},
    }
    assert "tau_by_prompt_length" not in build_report({"temperature": 1.0}, results, 4)


def test_speedups_come_from_unrounded_times():
    # two methods 0.3 us apart per token at ~776 us must report different speedups: dividing times
    # already rounded to the microsecond would make them equal to 7 digits
    tokens = list(range(1001))
    plain = [Generation(tokens=tokens, decode_s=1.869)]
    dflash = [Generation(tokens=tokens, accept_lengths=[4], verify_sizes=[4], decode_s=0.7762)]
    ngram = [Generation(tokens=tokens, accept_lengths=[2], verify_sizes=[4], decode_s=0.7759)]
    results = {"autoregressive": plain, "dflash": dflash, "ngram": ngram}
    report = build_report({"temperature": 0.0}, results, 4)
    assert report["speedup"]["dflash"] == pytest.approx(1.869 / 0.7762, rel=1e-6)
    assert report["speedup"]["ngram"] == pytest.approx(1.869 / 0.7759, rel=1e-6)
    assert report["dflash"]["time_per_output_token_s"] == pytest.approx(0.7762e-3, rel=1e-5)


def test_the_tau_ratio_interval_comes_from_resampling_prompts():
    from flashdraft.eval.report import tau_ratio

    ngram = [1.5, 2.0, 3.0, 1.2, 2.5, 4.0]
    assert tau_ratio([2 * t for t in ngram], ngram) == {"ratio": 2.0, "ci95": [2.0, 2.0], "samples": 6}
    dflash = [3.0, 2.2, 7.9, 2.1, 4.0, 3.0]
    r = tau_ratio(dflash, ngram)
    assert r["ratio"] == pytest.approx(sum(dflash) / sum(ngram))
    lo, hi = r["ci95"]
    assert lo < r["ratio"] < hi and hi - lo > 0.3  # six prompts: a wide interval
    assert tau_ratio(dflash, ngram) == r  # seeded
    assert tau_ratio([float("nan")], [2.0])["samples"] == 0


def test_sampled_drafts_are_seeded_and_refused_at_t0():
    """eval_tau and run_methods draft by sampling when asked (each prompt's generator seeds the drafts
    as well as the verification), and refuse it at T = 0."""
    s = tiny_setup()
    sampled = dict(temperature=1.0, draft_sampling="sample")
    taus = [eval_tau(s.target, None, s.trained, s.prompts[:2], 16, **sampled) for _ in range(2)]
    assert taus[0] == taus[1] and taus[0] > 1
    runs = [run_methods(s.target, s.trained, s.prompts[:2], 16, BLOCK, **sampled) for _ in range(2)]
    assert [g.tokens for g in runs[0]["dflash"]] == [g.tokens for g in runs[1]["dflash"]]
    with pytest.raises(ValueError, match="temperature > 0"):
        eval_tau(s.target, None, s.trained, s.prompts[:1], 16, draft_sampling="sample")


def test_run_methods_measures_all_three_on_every_prompt():
    s = tiny_setup()
    results = run_methods(s.target, s.trained, s.prompts[:2], 20, BLOCK)
    assert {m: len(g) for m, g in results.items()} == {"autoregressive": 2, "dflash": 2, "ngram": 2}
    assert all(
        g.tokens == p.tokens for g, p in zip(results["dflash"], results["autoregressive"], strict=True)
    )
    assert all(g.decode_s > 0 for gens in results.values() for g in gens)


@pytest.mark.parametrize(
    ("temperature", "block", "drafts"),
    [(0.0, BLOCK, "auto"), (1.0, BLOCK, "argmax"), (1.0, BLOCK, "sample"), (0.0, BLOCK // 2, "auto")],
)
def test_fixed_shape_decoding_matches_the_dynamic_cache_sample_by_sample(temperature, block, drafts):
    """The CUDA-graph path's static caches (run eagerly on the CPU): the same tokens and cycles as the
    cropped DynamicCache, for every method, with prompts of different lengths sharing the buffers,
    also when decoding with a smaller block than the drafter was trained with, and with sampled drafts
    (drawn outside the graph with each prompt's generator)."""
    s = tiny_setup()
    prompts = [s.prompts[0], s.prompts[1][:4], s.prompts[2] + s.prompts[3]]
    rule = {"draft_sampling": drafts}
    dynamic = run_methods(s.target, s.trained, prompts, 30, block, temperature, **rule)
    static = run_methods(s.target, s.trained, prompts, 30, block, temperature, cuda_graphs=True, **rule)
    for method in dynamic:
        for d, f in zip(dynamic[method], static[method], strict=True):
            assert f.tokens == d.tokens and f.accept_lengths == d.accept_lengths, method
    assert any(a > 1 for g in dynamic["dflash"] for a in g.accept_lengths)  # drafts were accepted


# ---- `flashdraft eval` ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_drafter_dir(tmp_path_factory, tiny_target_dir, tiny_tokenizer):
    from transformers import AutoConfig

    cfg = drafter_config(
        AutoConfig.from_pretrained(tiny_target_dir), 1, None, 2, 4, tiny_tokenizer.mask_token_id
    )
    drafter = DFlashDrafter(cfg)
    init_drafter_(drafter, std=0.02, seed=0)
    out = tmp_path_factory.mktemp("drafter")
    write_zlab(drafter, out)
    return out


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("eval")(eval_cmd)
    app.command("noop")(lambda: None)  # a second command keeps `eval` a subcommand
    return app


def _eval_args(target, drafter, prompts) -> list[str]:
    return ["eval", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts)]


def test_eval_cli_writes_report_plot_and_table(tmp_path, tiny_target_dir, tiny_drafter_dir):
    prompts = tmp_path / "prompts.jsonl"
    records = [
        {"messages": [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "dropped"}]},
        {"prompt": "import os"},
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    report_path = tmp_path / "out" / "report.json"
    args = _eval_args(tiny_target_dir, tiny_drafter_dir, prompts)
    args += ["--out", str(report_path), "--max-new-tokens", "12", "--device", "cpu"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["settings"]["num_prompts"] == 2 and report["settings"]["block_size"] == 4
    for method in ("autoregressive", "dflash", "ngram"):
        stats = report[method]
        assert stats["output_tokens"] > 0 and stats["tokens_per_s"] > 0
    dflash = report["dflash"]
    assert 1 <= dflash["tau"] <= 4 and len(dflash["acceptance_by_position"]) == 3
    assert sum(dflash["accept_length_histogram"].values()) == dflash["cycles"]
    assert report["identical_to_autoregressive"] == {"dflash": 2, "ngram": 2, "of": 2}
    assert report["speedup"]["dflash"] > 0 and report["speedup"]["ngram"] > 0
    assert report_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tau" in result.output and "speedup" in result.output
    assert report["settings"]["cuda_graphs"] is False and report["settings"]["draft_sampling"] == "argmax"

    # the fixed-shape path through the CLI: the same samples (CPU: no graphs captured)
    static_path = tmp_path / "out" / "static.json"
    args[args.index(str(report_path))] = str(static_path)
    result = CliRunner().invoke(_cli(), [*args, "--cuda-graphs"])
    assert result.exit_code == 0, result.output
    static = json.loads(static_path.read_text())
    assert static["settings"]["cuda_graphs"] is True
    for method in ("autoregressive", "dflash", "ngram"):
        assert static[method]["tau_per_sample"] == report[method]["tau_per_sample"]


def test_eval_cli_records_the_drafting_rule_with_and_without_cuda_graphs(
    tmp_path, tiny_target_dir, tiny_drafter_dir
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os"}) + "\n")
    report_path = tmp_path / "report.json"
    args = _eval_args(tiny_target_dir, tiny_drafter_dir, prompts)
    args += ["--out", str(report_path), "--max-new-tokens", "8", "--device", "cpu", "--temperature", "1"]
    result = CliRunner().invoke(_cli(), [*args, "--draft-sampling", "sample"])
    assert result.exit_code == 0, result.output
    assert json.loads(report_path.read_text())["settings"]["draft_sampling"] == "sample"
    sampled = json.loads(report_path.read_text())["dflash"]["tau_per_sample"]
    result = CliRunner().invoke(_cli(), [*args, "--draft-sampling", "sample", "--cuda-graphs"])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["settings"]["cuda_graphs"] is True and report["dflash"]["tau_per_sample"] == sampled


def test_eval_cli_rejects_a_bad_prompt_record(tmp_path, tiny_target_dir, tiny_drafter_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    args = _eval_args(tiny_target_dir, tiny_drafter_dir, prompts)
    result = CliRunner().invoke(_cli(), [*args, "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 2
    assert "prompts.jsonl:2" in result.output and "not a prompt" in result.output


@pytest.mark.parametrize(
    "record, says",
    [
        ({"messages": ["hi"]}, "turn 0 is a str"),
        ({"messages": [{"role": "user"}]}, "content is NoneType"),
        ({"messages": [{"role": "user", "content": 7}]}, "content is int"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "opens with an assistant turn"),
        ({"prompt": 5}, "`prompt` is int"),
        ({"prompt": " "}, "empty `prompt`"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_a_prompt_record_is_checked_as_training_data_is(tmp_path, record, says):
    """Prompts are read by the training data's rules: a bad record is an error naming its line and what
    is wrong, never a traceback from the chat template."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=f"prompts.jsonl:2: .*{re.escape(says)}"):
        read_prompts(path)
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(sharegpt).encode() + b"\r\n\r\n")  # a BOM, CRLF lines
    assert read_prompts(path) == [[{"role": "user", "content": "hi"}]]
    array = tmp_path / "prompts.json"
    array.write_text(json.dumps([{"prompt": "a"}, sharegpt]))
    assert read_prompts(array) == [[{"role": "user", "content": "a"}], [{"role": "user", "content": "hi"}]]
    with pytest.raises(ValueError, match="missing.jsonl: no such file"):
        read_prompts(tmp_path / "missing.jsonl")


def test_eval_cli_takes_stop_strings_and_humaneval_stops(tmp_path, tiny_target_dir, tiny_drafter_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os"}) + "\n")
    report_path = tmp_path / "report.json"
    args = _eval_args(tiny_target_dir, tiny_drafter_dir, prompts)
    args += ["--out", str(report_path), "--max-new-tokens", "8", "--device", "cpu"]
    result = CliRunner().invoke(_cli(), [*args, "--stop", r"a\nb\\n", "--humaneval-stops"])
    assert result.exit_code == 0, result.output
    stops = json.loads(report_path.read_text())["settings"]["stop_strings"]
    assert stops == ["a\nb\\n", "\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    result = CliRunner().invoke(_cli(), [*args, "--stop", ""])
    assert result.exit_code == 2 and "empty stop string" in result.output
    result = CliRunner().invoke(_cli(), [*args, "--humaneval-stops", "--reference"])
    assert result.exit_code == 2 and "without stops" in result.output
