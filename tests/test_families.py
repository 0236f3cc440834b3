"""The conformance matrix: one tiny random model per target family (tests/families.py) through what a user
does with it. Packed rows keep documents apart (features of a packed row equal each document run alone),
a drafter block in a row's second document drafts as in that document alone, `flashdraft train` runs on
packed data, its checkpoint reloads and exports, the reference `dflash` package accepts what ours does
(Qwen3, Llama: the families it supports), speculative decoding reproduces the target's greedy output
(dynamic and, where the family allows it, fixed-shape caches), `flashdraft eval` says so, and the local
regeneration backend answers as plain greedy decoding does.

Each family's model, run and fitted drafter are built once per module (module-scoped fixtures)."""

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

import families
from flashdraft.cli.main import app
from flashdraft.data.packing import (
    PackedLoader,
    collate_rows,
    load_token_dataset,
    pack_documents,
    save_token_dataset,
)
from flashdraft.data.regenerate import LocalBackend
from flashdraft.demo.tiny import save_target
from flashdraft.eval.spec import DFlashProposer, generate, static_decoders
from flashdraft.export.formats import export_checkpoint, read_zlab
from flashdraft.model.checkpoint import latest_checkpoint, load_drafter, write_zlab
from flashdraft.model.drafter import DFlashDrafter, drafter_config
from flashdraft.model.target import PACKING_LINES, Target, choose_packing, load_target, target_config
from flashdraft.train.blocks import Anchors
from flashdraft.train.build import init_drafter_
from flashdraft.train.step import micro_batch_at, target_features, visibility_for
from helpers import GAMMA, random_docs
from test_data_regenerate import reference as regenerate_reference
from test_eval_spec import train_on_continuations

BLOCK = 8
NEW_TOKENS = 24
# a sliding-window layer's static cache is a ring, a linear-attention layer's state a running sum
NO_STATIC_CACHE = {"mistral", "gemma3_text", "gemma3", "gpt_oss", "qwen3_next"}
REFERENCE_FAMILIES = {"qwen3", "llama"}  # the families the reference dflash package decodes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", params=list(families.FAMILIES))
def family(request, tiny_tokenizer, tmp_path_factory) -> SimpleNamespace:
    name, tok = request.param, tiny_tokenizer
    model = families.build(name, len(tok), tok.eos_token_id, tok.pad_token_id)
    root = tmp_path_factory.mktemp(name)
    shape = families.DRAFTER_SHAPES.get(name, {})
    dcfg = drafter_config(model.config, 2, None, 2, BLOCK, tok.mask_token_id, **shape)
    return SimpleNamespace(
        name=name,
        model=model,
        tokenizer=tok,
        dir=save_target(model, tok, root / "target"),
        root=root,
        dcfg=dcfg,
        packing=choose_packing(model, dcfg.target_layer_ids),
        expected_packing=families.FAMILIES[name][2],
        drafter_shape=shape,
    )


def _drafter(family, seed: int = 0) -> DFlashDrafter:
    drafter = DFlashDrafter(family.dcfg)
    init_drafter_(drafter, 0.1, seed=seed)
    return drafter.eval()


def _prompts(n: int = 4, length: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 380, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def fitted(family) -> SimpleNamespace:
    """A drafter fitted to the target's greedy continuations, so that decoding accepts many drafts."""
    drafter = _drafter(family).train()
    target = Target(family.model, drafter.target_layer_ids)
    prompts = _prompts()
    train_on_continuations(drafter, target, prompts)
    return SimpleNamespace(drafter=drafter.eval(), target=target, prompts=prompts)


@pytest.fixture(scope="module")
def run(family) -> SimpleNamespace:
    """`flashdraft train` for two steps on packed data (documents of 30-60 tokens in rows of 128)."""
    data, out = family.root / "data", family.root / "run"
    save_token_dataset(random_docs([30, 45, 60, 38, 52, 41, 33, 57], seed=3, prompt_len=6), data)
    config = family.root / "train.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "drafter": {"num_layers": 2, "num_taps": 2, "block_size": BLOCK, **family.drafter_shape},
                "data": {"seq_len": 128, "rows_per_batch": 2},
                "num_anchors": 8,
                "max_steps": 2,
                "log_every": 1,
            }
        )
    )
    args = ["train", "--target", str(family.dir), "--data", str(data), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--config", str(config), "--device", "cpu"])
    return SimpleNamespace(result=result, out=out, data=data)


def test_the_target_keeps_the_documents_of_a_packed_row_apart(family):
    """The leak test: every document's features in its row equal its features alone. Documents are
    longer than the sliding windows. A target that cannot keep them apart gets one document per row,
    and the probe says why: packed, its second document would see the first."""
    target = Target(family.model, family.dcfg.target_layer_ids, packing=family.packing)
    docs = random_docs([20, 27], seed=1)
    rows = pack_documents([20, 27], 64, [0, 1], one_per_row=family.packing == "one_document")
    batch = collate_rows([[docs[i] for i in row] for row in rows], 64, pad_token_id=0)
    feats = target_features(target, batch)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(docs[i]["input_ids"])
            alone = target.features(torch.tensor([docs[i]["input_ids"]]))
            torch.testing.assert_close(feats[r, start : start + n], alone[0], atol=1e-5, rtol=1e-5)
            start += n
    assert len(rows) == (2 if family.packing == "one_document" else 1)
    if family.packing == "one_document":
        assert target.leaks("positions")
    assert family.packing == family.expected_packing  # what docs/targets.md says of the family


def test_a_target_loaded_up_to_its_last_tap_gives_the_whole_targets_features(family):
    """load_target(layers=N) holds the first N decoder layers alone; its features on packed rows are the
    whole target's, and it refuses to decode; at N = 0 the embedding and lm_head are the target's."""
    ids = family.dcfg.target_layer_ids
    whole = target_config(family.dir)
    model, _ = load_target(family.dir, layers=max(ids) + 1)
    part = Target(model, ids, family.packing, config=whole)
    assert part.loaded_layers == max(ids) + 1 < part.num_layers == families.LAYERS
    assert f"the first {max(ids) + 1} loaded" in part.describe()
    full = Target(load_target(family.dir)[0], ids, family.packing)
    g = torch.Generator().manual_seed(0)
    ids_row = torch.randint(4, 380, (1, 24), generator=g)
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    torch.testing.assert_close(part.features(ids_row, positions), full.features(ids_row, positions))
    with pytest.raises(RuntimeError, match="decoding needs the target's first 6 layers; this model holds"):
        part.decode(ids_row)
    heads, _ = load_target(family.dir, layers=0)
    assert Target(heads, ids, config=whole).loaded_layers == 0
    assert torch.equal(heads.get_input_embeddings().weight, full.embed_tokens.weight)
    assert torch.equal(heads.get_output_embeddings().weight, full.lm_head.weight)
    modules = [*model.modules(), *full.model.modules()]
    assert not any(m._forward_hooks for m in modules)  # the taps lived for one forward


def test_a_block_in_the_second_document_drafts_as_in_that_document_alone(family):
    """Positions restart in every document: a block anchored in the second document of a packed row
    (context: that document's earlier tokens at their own positions) gives the logits of the same
    block in the document alone."""
    target = Target(family.model, family.dcfg.target_layer_ids)
    drafter = _drafter(family)
    first, second = random_docs([20, 27], seed=2)
    feats = [target.features(torch.tensor([d["input_ids"]])) for d in (first, second)]
    packed = collate_rows([[first, second]], 64, pad_token_id=0)
    alone = collate_rows([[second]], 32, pad_token_id=0)
    width = feats[0].shape[-1]
    packed_feats = torch.cat([*feats, torch.zeros(1, 64 - 47, width)], 1)
    alone_feats = torch.cat([feats[1], torch.zeros(1, 32 - 27, width)], 1)

    def block_logits(batch, features, anchor):
        anchors = Anchors(torch.tensor([[anchor]]), torch.tensor([[True]]))
        mb = micro_batch_at(batch, anchors, BLOCK, drafter.mask_token_id, GAMMA, features)
        vis = visibility_for(mb, BLOCK, "dense", compiled=False)
        embeds = target.embed(mb.blocks.input_ids)
        with torch.no_grad():
            hidden = drafter(embeds, mb.blocks.positions, None, vis, features, batch.position_ids)
            return target.lm_head(hidden)

    torch.testing.assert_close(
        block_logits(packed, packed_feats, 20 + 9), block_logits(alone, alone_feats, 9)
    )


def test_flashdraft_train_runs_on_packed_data(family, run):
    assert run.result.exit_code == 0, run.result.output
    assert f"packed rows: {PACKING_LINES[family.expected_packing]}" in run.result.output
    rows = PackedLoader(load_token_dataset(run.data), 128, 2, 0, 0, family.packing == "one_document").rows(0)
    most = max(len(r) for r in rows)  # documents in the fullest row
    assert most == 1 if family.packing == "one_document" else most > 1
    lines = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and all(math.isfinite(m["loss"]) for m in lines)


def test_the_checkpoint_reloads_and_exports_in_the_zlab_layout(family, run):
    ckpt = latest_checkpoint(run.out / "checkpoints")
    saved = load_file(str(ckpt / "model.safetensors"))
    drafter = load_drafter(ckpt)
    assert all(torch.equal(drafter.state_dict()[k].to(v.dtype), v) for k, v in saved.items())
    out = export_checkpoint(ckpt, "zlab", family.root / "zlab")
    cfg, weights = read_zlab(out)  # validated: every field and tensor an engine reads
    ids = cfg["dflash_config"]["target_layer_ids"]
    assert ids == family.dcfg.target_layer_ids and cfg["eagle_aux_hidden_state_layer_ids"] == [
        i + 1 for i in ids
    ]
    assert cfg["num_target_layers"] == families.LAYERS
    assert cfg["rope_parameters"] == family.dcfg.rope_parameters  # the target's RoPE, whatever its form
    assert all(cfg[k] == v for k, v in family.drafter_shape.items())  # a shape set by hand is the one trained
    reloaded = load_drafter(out)
    assert all(torch.equal(reloaded.state_dict()[k].to(v.dtype), v) for k, v in weights.items())


def test_the_reference_package_accepts_what_our_decoding_accepts(family, fitted, tmp_path, monkeypatch):
    if family.name not in REFERENCE_FAMILIES:
        pytest.skip(f"the reference dflash package decodes {sorted(REFERENCE_FAMILIES)} targets")
    reference = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its stats timer is CUDA-only
    (tmp_path / "ckpt").mkdir()
    write_zlab(fitted.drafter, tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", "zlab", tmp_path / "zlab")
    ref = reference.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_drafter(out).eval()
    lengths = []
    for prompt in fitted.prompts:
        ids = torch.tensor([prompt])
        theirs = reference.dflash_generate(ref, family.model, ids, NEW_TOKENS, None, return_stats=True)
        mine = generate(fitted.target, ids, NEW_TOKENS, DFlashProposer(ours, fitted.target), BLOCK)
        assert mine.accept_lengths == theirs.acceptance_lengths
        assert mine.tokens == theirs.output_ids[0, len(prompt) :].tolist()
        lengths += mine.accept_lengths
    assert sum(lengths) / len(lengths) > 2  # drafts were accepted: the comparison covers accepting cycles


def test_speculative_decoding_gives_the_targets_greedy_output(family, fitted):
    """Against transformers' own greedy `generate`, which stops at the end-of-sequence token."""
    accepted, eos = 0, family.tokenizer.eos_token_id
    for prompt in fitted.prompts:
        ids = torch.tensor([prompt])
        proposer = DFlashProposer(fitted.drafter, fitted.target)
        spec = generate(fitted.target, ids, NEW_TOKENS, proposer, BLOCK, stop_token_ids=[eos])
        with torch.no_grad():
            hf = family.model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt) :]
        assert spec.tokens == hf.tolist()
        accepted += sum(a - 1 for a in spec.accept_lengths)
    assert accepted > NEW_TOKENS  # accepting and rejecting cycles both ran (a cache rolled back too)


def test_fixed_shape_decoding_matches_or_is_refused_with_its_reason(family, fitted):
    prompts = fitted.prompts[:2]
    if family.name in NO_STATIC_CACHE:
        with pytest.raises(ValueError, match="static decoding needs a plain static KV cache"):
            static_decoders(fitted.target, fitted.drafter, prompts, NEW_TOKENS, BLOCK)
        return
    static, proposer = static_decoders(fitted.target, fitted.drafter, prompts, NEW_TOKENS, BLOCK)
    for prompt in prompts:
        ids = torch.tensor([prompt])
        dynamic = generate(
            fitted.target, ids, NEW_TOKENS, DFlashProposer(fitted.drafter, fitted.target), BLOCK
        )
        fixed = generate(fitted.target, ids, NEW_TOKENS, proposer, BLOCK, static=static)
        assert fixed.tokens == dynamic.tokens and fixed.accept_lengths == dynamic.accept_lengths


def test_a_sliding_window_target_decodes_on_fixed_shapes_within_its_window():
    """Gemma 3 with a window that holds every decoded position (Gemma 3 270M's 512 holds a HumanEval
    prompt and 192 new tokens): its sliding layers' static caches are plain ones, and the drafts a trained
    drafter proposes are verified as without fixed shapes; past the window it is refused."""
    tokens = dict(vocab_size=96, eos_token_id=1, pad_token_id=0)
    config = families.family_config("gemma3_text", **tokens)
    config.sliding_window = 64
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    drafter = DFlashDrafter(drafter_config(model.config, 2, None, 2, BLOCK, 95))
    init_drafter_(drafter, std=0.1, seed=0)
    target = Target(model, drafter.target_layer_ids)
    prompts = [
        torch.randint(2, 90, (12,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)
    ]
    train_on_continuations(drafter, target, prompts, steps=40)
    drafter.eval()
    static, proposer = static_decoders(target, drafter, prompts, NEW_TOKENS, BLOCK)  # 12 + 24 + 8 <= 64
    accepted = 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        dynamic = generate(target, ids, NEW_TOKENS, DFlashProposer(drafter, target), BLOCK)
        fixed = generate(target, ids, NEW_TOKENS, proposer, BLOCK, static=static)
        assert fixed.tokens == dynamic.tokens and fixed.accept_lengths == dynamic.accept_lengths
        accepted += sum(a - 1 for a in fixed.accept_lengths)
    assert accepted > 0  # verified drafts were accepted: the cache rewound past rejected ones too
    with pytest.raises(ValueError, match="static decoding needs a plain static KV cache"):
        static_decoders(target, drafter, prompts, 64, BLOCK)


def test_flashdraft_eval_decodes_as_plain_decoding(family, run):
    prompts = family.root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):", "import os")))
    ckpt = latest_checkpoint(run.out / "checkpoints")
    report = family.root / "eval" / "report.json"
    args = ["eval", "--target", str(family.dir), "--drafter", str(ckpt), "--prompts", str(prompts)]
    result = CliRunner().invoke(
        app, [*args, "--out", str(report), "--max-new-tokens", "16", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    written = json.loads(report.read_text())
    assert written["identical_to_autoregressive"] == {"dflash": 2, "ngram": 2, "of": 2}
    # chosen per model: gpt-oss refuses sdpa
    assert written["settings"]["target_attention"] == ("eager" if family.name == "gpt_oss" else "sdpa")


def test_the_target_attention_is_the_one_asked_or_refused(family):
    """auto is the model's own choice; a name is used as given, and one the model refuses is an error
    naming it (gpt-oss has no sdpa attention), never another implementation in its place."""
    auto, _ = load_target(family.dir)
    assert auto.config.get_text_config()._attn_implementation == (
        "eager" if family.name == "gpt_oss" else "sdpa"
    )
    eager, _ = load_target(family.dir, attention="eager")
    assert eager.config.get_text_config()._attn_implementation == "eager"
    if family.name == "gpt_oss":
        with pytest.raises(ValueError, match="target attention 'sdpa'"):
            load_target(family.dir, attention="sdpa")


def test_local_regeneration_answers_as_plain_greedy_decoding(family):
    """Left-padded batches on the default attention (grouped on sdpa, the model's own otherwise)."""
    tok = family.tokenizer
    conversations = [
        [{"role": "user", "content": "hello there"}],
        [{"role": "user", "content": "a much longer question about the source"}],
    ]
    expected = [regenerate_reference(family.model, tok, c, 6).messages for c in conversations]
    own = family.model.config._attn_implementation
    backend = LocalBackend(family.model, tok, max_new_tokens=6, batch_size=2)
    try:
        assert backend.attention_name == ("grouped_decode_matmul" if own == "sdpa" else own)
        assert backend.regenerate(conversations) == expected
    finally:
        family.model.set_attn_implementation(own)
