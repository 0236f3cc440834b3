"""The embedding scale against a direct computation. Gemma multiplies its token embeddings by
sqrt(hidden_size) inside its embedding module, and the engines give a DFlash drafter of a Gemma target
the same product: llama.cpp (build 11434, src/models/dflash.cpp) looks the target's token_embd up and
multiplies by the drafter GGUF's `dflash.embedding_scale`, which its converter sets to sqrt(hidden_size)
for a Gemma target (conversion/qwen.py, DFlashModel.set_gguf_parameters); the reference package's MLX
backend multiplies by the target's `embed_scale`. So what the drafter receives, in training
(micro_step_loss) and in decoding (DFlashProposer), must be `weight[ids] * sqrt(hidden_size)` for Gemma
targets and `weight[ids]` for the others, and the GGUF export must record the factor the drafter was
trained with."""

import math

import gguf
import pytest
import torch

import families
import tiny_gemma3
from flashdraft.data.packing import collate_rows
from flashdraft.eval.spec import DFlashProposer
from flashdraft.export.formats import export_checkpoint
from flashdraft.export.gguf_target import write_gguf_target
from flashdraft.model.checkpoint import write_zlab
from flashdraft.model.target import Target, load_target
from flashdraft.train.blocks import Anchors
from flashdraft.train.step import Kernels, micro_batch_at, micro_step_loss
from helpers import BLOCK, GAMMA, MASK_ID, VOCAB, random_docs, tiny_drafter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def drafter_inputs(target: Target, drafter) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(block ids, what the drafter's forward received as the block's embeddings): one training
    micro-batch of two blocks, then one decoding proposal after a prompt."""
    seen = []
    hook = drafter.register_forward_pre_hook(lambda _module, args: seen.append(args[0].detach().clone()))
    batch = collate_rows([random_docs([30], seed=1)], 32, pad_token_id=0)
    anchors = Anchors(torch.tensor([[5, 17]]), torch.tensor([[True, True]]))
    mb = micro_batch_at(batch, anchors, BLOCK, MASK_ID, GAMMA)
    micro_step_loss(drafter, target, mb, Kernels("dense"))  # the CPU's attention
    prompt = torch.tensor([random_docs([12], seed=2)[0]["input_ids"]])
    proposer = DFlashProposer(drafter, target)
    proposer.observe(prompt, target.features(prompt), 0)
    last = torch.tensor([7])
    proposer.propose(last, prompt.shape[1], BLOCK - 1)
    hook.remove()
    block = torch.cat([last, torch.full((BLOCK - 1,), MASK_ID)])[None]
    return list(zip([mb.blocks.input_ids, block], seen, strict=True))


@pytest.mark.parametrize("family", ["gemma3_text", "gemma3", "qwen3", "llama"])
def test_the_drafter_receives_the_embedding_rows_times_the_targets_scale(family):
    model = families.build(family, VOCAB, eos_token_id=1, pad_token_id=0)
    hidden = model.config.get_text_config().hidden_size
    scale = math.sqrt(hidden) if family.startswith("gemma") else 1.0
    drafter = tiny_drafter(model)
    target = Target(model, drafter.target_layer_ids)
    assert target.embedding_scale == scale
    weight = model.get_input_embeddings().weight
    for ids, received in drafter_inputs(target, drafter):
        assert received.shape == (*ids.shape, hidden)
        assert torch.equal(received, weight[ids] * scale)  # computed directly, in f32 as the target


def test_in_bf16_the_product_is_rounded_once_as_llama_cpps_f32_scale_gives_it():
    """Gemma's own embedding forward rounds the scale to the table's dtype first (Gemma 3 270M's
    sqrt(640) = 25.30 is 25.25 in bf16, 0.2% off); the drafter's input is the f32 product rounded once."""
    model = families.build("gemma3_text", VOCAB, eos_token_id=1, pad_token_id=0).to(torch.bfloat16)
    target = Target(model, [1, 3])
    weight, scale = model.get_input_embeddings().weight, math.sqrt(model.config.hidden_size)
    ids = torch.arange(VOCAB)[None]
    assert torch.equal(target.embed(ids), (weight[ids].float() * scale).to(torch.bfloat16))


def test_the_gguf_export_records_the_scale_the_drafter_was_trained_with(tiny_target_dir, tmp_path):
    """The tiny Gemma 3 target as llama-server serves it (tests/tiny_gemma3.py), loaded from its .gguf
    as flashdraft trains on it: the drafter's block input is its rows times sqrt(hidden_size), and the
    drafter's GGUF says that factor; for a Qwen3 target it says none (llama.cpp then scales by 1)."""
    gemma_gguf = tiny_gemma3.write_target(tmp_path)[-1]
    qwen_gguf = write_gguf_target(tiny_target_dir, tmp_path / "qwen3.gguf")
    # (what flashdraft trains against, the file llama-server serves, the scale)
    cases = [(gemma_gguf, gemma_gguf, math.sqrt(tiny_gemma3.HIDDEN)), (tiny_target_dir, qwen_gguf, None)]
    for source, served, scale in cases:
        model, _ = load_target(source, "cpu")
        drafter = tiny_drafter(model)
        target = Target(model, drafter.target_layer_ids)
        ids = torch.tensor([[2, 40, 41, MASK_ID, MASK_ID, MASK_ID]])
        rows = model.get_input_embeddings().weight[ids]
        assert torch.equal(target.embed(ids), rows * (scale or 1.0))
        ckpt = tmp_path / f"{served.stem}-ckpt"
        ckpt.mkdir()
        write_zlab(drafter, ckpt)
        out = export_checkpoint(ckpt, "gguf", tmp_path / f"{served.stem}-drafter.gguf", verifier=str(served))
        fields = gguf.GGUFReader(out).fields
        if scale is None:
            assert "dflash.embedding_scale" not in fields
        else:
            assert fields["dflash.embedding_scale"].contents() == pytest.approx(scale, rel=1e-7)
            assert target.embedding_scale == scale


def test_the_reference_package_decodes_a_gemma_targets_drafter_with_our_acceptance(tmp_path, monkeypatch):
    """A drafter trained (build_drafter's config, a few seconds) on a tiny Gemma 3's greedy continuations
    records the scale its block input had; exported, the reference package (its transformers backend
    looks the rows up raw and multiplies by dflash_config.input_embedding_scale) accepts what ours does,
    prompt by prompt. Without the recorded scale it would feed rows 8 times smaller."""
    reference = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    import time

    from flashdraft.config import resolve_config
    from flashdraft.eval.spec import generate
    from flashdraft.train.build import build_drafter
    from test_eval_spec import train_on_continuations

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its stats timer is CUDA-only
    model = families.build("gemma3_text", VOCAB, eos_token_id=1, pad_token_id=0)
    spec = {"drafter.num_layers": 2, "drafter.num_taps": 2, "drafter.block_size": BLOCK}
    drafter = build_drafter(resolve_config("default", **spec), model, MASK_ID, "cpu")
    assert drafter.config.input_embedding_scale == math.sqrt(model.config.hidden_size)
    target = Target(model, drafter.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, VOCAB - 1, (10,), generator=g).tolist() for _ in range(3)]
    train_on_continuations(drafter, target, prompts)
    (tmp_path / "ckpt").mkdir()
    write_zlab(drafter.eval(), tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", "zlab", tmp_path / "zlab")
    ref = reference.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        theirs = reference.dflash_generate(ref, model, ids, 40, None, temperature=0.0, return_stats=True)
        mine = generate(target, ids, 40, DFlashProposer(drafter, target), BLOCK)
        assert mine.accept_lengths == theirs.acceptance_lengths and mine.tau > 1.5
