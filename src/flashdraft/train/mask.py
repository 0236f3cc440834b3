"""The drafter's MASK token: what fills a block's slots after its first (docs/dflash.md, the drafter).

The drafter reads its block through the target's embedding, so MASK must be a row of it, and one that
means nothing else to the drafter: a token the training data or the chat template holds would make a
masked slot look like real text. `choose_mask_token` picks it and says which rule did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

FIELD = "drafter.mask_token_id"
# special tokens whose names say that nothing uses them (Llama 3's <|reserved_special_token_N|>)
UNUSED_NAMES = ("unused", "reserved")


@dataclass(frozen=True)
class MaskChoice:
    """The MASK id, its token's text (None: a row with no token) and the rule that chose it; `automatic`:
    chosen here, not given by the user."""

    id: int
    token: str | None
    rule: str
    automatic: bool = True

    def describe(self) -> str:
        """The start-up line."""
        text = "" if self.token is None else f" {self.token!r}"
        why = f"{self.rule}; {FIELD} overrides" if self.automatic else self.rule
        return f"mask token {self.id}{text} ({why})"


def choose_mask_token(
    tokenizer,
    embedding_rows: int,
    requested: int | None,
    token_counts: Callable[[Sequence[int]], Sequence[int]] | None,
    requested_by: str = FIELD,
) -> MaskChoice:
    """The MASK token, by the first rule that gives one:

    1. `requested` (drafter.mask_token_id, or an init_from drafter's): the user's choice;
    2. the tokenizer's own mask token, made for the purpose;
    3. the first embedding row past the tokenizer's vocabulary (Qwen3: 151669), which no text encodes;
    4. a special token of the tokenizer that no role (bos/eos/pad/unk), no chat template and no training
       document holds (`token_counts(ids)`: how often each id occurs in the training data; None: the
       data cannot be read, and no special token is taken unchecked). Tokens named unused or reserved
       come first, then the others, each in id order, so the choice is the same on every run and rank.
    Else a ValueError that names what was tried. The id is always checked to be an embedding row.
    """
    if requested is not None:
        choice = MaskChoice(int(requested), _text(tokenizer, requested), requested_by, automatic=False)
        return _checked(choice, embedding_rows)
    if tokenizer is None:
        raise ValueError(f"the target has no tokenizer to take a MASK token from: set {FIELD}")
    if getattr(tokenizer, "mask_token_id", None) is not None:
        choice = MaskChoice(tokenizer.mask_token_id, tokenizer.mask_token, "the tokenizer's mask token")
        return _checked(choice, embedding_rows)
    if len(tokenizer) < embedding_rows:
        return MaskChoice(len(tokenizer), None, "the first embedding row past the tokenizer")
    spare = spare_special_tokens(tokenizer, embedding_rows)
    if not spare:
        why = "every special token is bos/eos/pad/unk or in the chat template"
    elif token_counts is None:
        why = f"its {len(spare)} spare special tokens cannot be checked against the training data"
    else:
        counts = token_counts([i for i, _ in spare])
        free = [(i, text) for (i, text), n in zip(spare, counts, strict=True) if n == 0]
        if free:
            return MaskChoice(*free[0], "an unused special token of the tokenizer")
        why = f"its {len(spare)} spare special tokens all occur in the training data"
    raise ValueError(
        f"no MASK token for the drafter: the tokenizer has no mask token, the target's {embedding_rows}-row "
        f"embedding has no row past its {len(tokenizer)}-token vocabulary, and {why}: set {FIELD} to a "
        "rarely used token id"
    )


def spare_special_tokens(tokenizer, embedding_rows: int) -> list[tuple[int, str]]:
    """(id, text) of the tokenizer's special tokens that are none of bos/eos/pad/unk and occur in no
    chat template: those named unused or reserved first, then the others, each in id order."""
    roles = {getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "pad", "unk")}
    template = getattr(tokenizer, "chat_template", None)
    templates = list(template.values()) if isinstance(template, dict) else [template] if template else []
    spare = [
        (i, added.content)
        for i, added in sorted(tokenizer.added_tokens_decoder.items())
        if added.special
        and i not in roles
        and i < embedding_rows
        and not any(added.content in text for text in templates)
    ]
    return sorted(spare, key=lambda it: not any(name in it[1].lower() for name in UNUSED_NAMES))


def count_tokens(dataset, ids: Sequence[int], rows_per_batch: int = 4096) -> np.ndarray:
    """How often each of `ids` occurs in a token dataset's input_ids: a bincount over the column's Arrow
    buffers, `rows_per_batch` documents at a time, so a large dataset costs one pass and little memory."""
    ids = np.asarray(ids, dtype=np.int64)
    counts = np.zeros(len(ids), dtype=np.int64)
    if not len(ids):
        return counts
    for chunk in dataset.data.column("input_ids").chunks:
        for start in range(0, len(chunk), rows_per_batch):
            values = chunk.slice(start, rows_per_batch).flatten().to_numpy()
            counts += np.bincount(values, minlength=int(ids.max()) + 1)[ids]
    return counts


def _checked(choice: MaskChoice, embedding_rows: int) -> MaskChoice:
    if not 0 <= choice.id < embedding_rows:
        raise ValueError(
            f"mask token {choice.id} ({choice.rule}) is not a row of the target's {embedding_rows}-row "
            f"embedding: set {FIELD} to one"
        )
    return choice


def _text(tokenizer, token_id: int) -> str | None:
    """The token's text, None for a row past the tokenizer (or no tokenizer)."""
    if tokenizer is None or not 0 <= token_id < len(tokenizer):
        return None
    return tokenizer.convert_ids_to_tokens(int(token_id))
