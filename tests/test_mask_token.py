"""The drafter's MASK token: the config's choice, else the tokenizer's mask token, else a spare embedding
row, else a special token that no role, chat template or training document uses (train/mask.py)."""

import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from flashdraft.config import resolve_config
from flashdraft.data.packing import load_token_dataset, save_token_dataset
from flashdraft.train.build import build_trainer
from flashdraft.train.mask import choose_mask_token, count_tokens

WORDS = ["<unk>", "<s>", "</s>", "hello", "world"]  # ids 0-4; the special tokens come after them
TEMPLATE = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"


def tokenizer(specials=(), mask=None, template=TEMPLATE) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: bos/eos/pad/unk among its first ids, an added token that is not special,
    then `specials` (and `mask`) as special tokens, in that order."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens(["<think>"])
    tok.add_special_tokens([*specials, *([mask] if mask else [])])
    roles = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>", "unk_token": "<unk>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, mask_token=mask, **roles)
    fast.chat_template = template
    return fast


def nowhere(ids):
    """token_counts of data that holds none of `ids`."""
    return [0] * len(ids)


def test_the_configs_mask_token_id_wins_over_every_other_rule():
    tok = tokenizer(["<|reserved_0|>"], mask="<mask>")
    choice = choose_mask_token(tok, len(tok) + 10, 3, nowhere)
    assert (choice.id, choice.token) == (3, "hello")
    assert choice.describe() == "mask token 3 'hello' (drafter.mask_token_id)"
    with pytest.raises(ValueError, match=r"mask token 17 \(drafter.mask_token_id\) is not a row of the"):
        choose_mask_token(tok, len(tok), 17, nowhere)


def test_the_tokenizers_mask_token_comes_next_then_a_row_past_the_tokenizer():
    tok = tokenizer(["<|reserved_0|>"], mask="<mask>")
    choice = choose_mask_token(tok, len(tok) + 10, None, nowhere)
    assert (choice.id, choice.token) == (tok.mask_token_id, "<mask>")
    assert "(the tokenizer's mask token; drafter.mask_token_id overrides)" in choice.describe()

    tok = tokenizer(["<|reserved_0|>"])
    choice = choose_mask_token(tok, len(tok) + 10, None, nowhere)
    assert (choice.id, choice.token) == (len(tok), None)
    assert choice.describe() == (
        f"mask token {len(tok)} (the first embedding row past the tokenizer; drafter.mask_token_id overrides)"
    )


def test_else_a_special_token_that_nothing_uses_those_named_unused_or_reserved_first():
    tok = tokenizer(["<tool>", "<extra>", "<|reserved_0|>"])
    choice = choose_mask_token(tok, len(tok), None, nowhere)
    assert choice.token == "<|reserved_0|>" and choice.id == tok.convert_tokens_to_ids("<|reserved_0|>")
    assert choice.describe() == (
        f"mask token {choice.id} '<|reserved_0|>' (an unused special token of the tokenizer; "
        "drafter.mask_token_id overrides)"
    )
    # no name says so: the first in id order, past bos/eos/pad/unk (special tokens with lower ids) and
    # <think> (not special)
    assert {tok.bos_token_id, tok.eos_token_id, tok.unk_token_id} < set(tok.added_tokens_decoder)
    tok = tokenizer(["<tool>", "<extra>"])
    assert choose_mask_token(tok, len(tok), None, nowhere).token == "<tool>"


def test_a_special_token_of_the_chat_template_is_skipped():
    tok = tokenizer(["<tool>", "<extra>"], template=TEMPLATE + "{{ '<tool>' }}")
    assert choose_mask_token(tok, len(tok), None, nowhere).token == "<extra>"
    tok = tokenizer(["<tool>", "<extra>"], template=None)  # no template: nothing to skip
    assert choose_mask_token(tok, len(tok), None, nowhere).token == "<tool>"


def test_a_special_token_the_training_data_holds_is_skipped(tmp_path):
    tok = tokenizer(["<tool>", "<extra>"])
    tool, extra = tok.convert_tokens_to_ids(["<tool>", "<extra>"])
    docs = [{"input_ids": [3, 4] * 30, "loss_mask": [1] * 60} for _ in range(5)]
    docs[3]["input_ids"][17] = tool  # once, in one document of the middle of the data
    save_token_dataset(docs, tmp_path)
    data = load_token_dataset(tmp_path)
    assert list(count_tokens(data, [tool, extra, 3], rows_per_batch=2)) == [1, 0, 150]
    choice = choose_mask_token(tok, len(tok), None, lambda ids: count_tokens(data, ids, rows_per_batch=2))
    assert choice.token == "<extra>"


def test_with_nothing_free_the_error_says_what_was_tried_and_names_the_setting():
    tok = tokenizer(["<tool>", "<extra>"])
    with pytest.raises(
        ValueError, match="2 spare special tokens all occur in the training data: set drafter"
    ):
        choose_mask_token(tok, len(tok), None, lambda ids: [1] * len(ids))
    with pytest.raises(
        ValueError, match="cannot be checked against the training data: set drafter.mask_token_id"
    ):
        choose_mask_token(tok, len(tok), None, None)
    tok = tokenizer(["<tool>"], template=TEMPLATE + "<tool>")
    with pytest.raises(
        ValueError, match=r"no mask token, .*no row past its \d+-token vocabulary, and every spec"
    ):
        choose_mask_token(tok, len(tok), None, nowhere)


def test_flashdraft_train_chooses_the_token_from_its_data_and_names_it(tmp_path, tiny_target_dir, capsys):
    """A target whose tokenizer has no mask token and no embedding row past it: `build` chooses <|mask|>,
    a special token that its data does not hold, and names it on the start-up lines; with data that holds
    it, nothing is left to choose."""
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    tok = AutoTokenizer.from_pretrained(target)
    mask_id, tok.mask_token = tok.mask_token_id, None  # <|mask|> stays a special token
    tok.save_pretrained(target)
    cfg = resolve_config("tiny_cpu", max_steps=1, **{"drafter.num_layers": 1})
    docs = [{"input_ids": [10 + i % 50 for i in range(80)], "loss_mask": [1] * 80} for _ in range(24)]
    save_token_dataset(docs, tmp_path / "data")
    trainer = build_trainer(cfg, str(target), str(tmp_path / "data"), str(tmp_path / "run"), device="cpu")
    assert trainer.drafter.mask_token_id == mask_id
    assert (
        f"mask token {mask_id} '<|mask|>' (an unused special token of the tokenizer;"
        in capsys.readouterr().out
    )
    trainer.close()

    docs[5]["input_ids"][40] = mask_id
    save_token_dataset(docs, tmp_path / "held")
    with pytest.raises(ValueError, match="1 spare special tokens all occur in the training data"):
        build_trainer(cfg, str(target), str(tmp_path / "held"), str(tmp_path / "run2"), device="cpu")
