"""The token-exact check of a trajectory: are its ids what the chat template makes of its final conversation?

A stitched trajectory is the prompt's ids, then model turns (ids the engine sampled) and context turns
(ids appended for tool / user messages) alternating. Walking it against the text the template renders
for the final conversation (or, for `/v1/completions`, the final prompt and completion), each stretch
must sit at the same place in that text: a model turn must decode to exactly that text (its ids are the
model's and are never re-tokenized), a context stretch must be exactly the tokenizer's ids of that text.
After the last model turn the text may only go on with the end-of-turn text the model did not write.
`first_mismatch` returns the position (in prompt + response ids) of the first token where this fails,
None when the trajectory is token-exact.
"""

from __future__ import annotations

from typing import Any


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _stretches(prompt_ids: list[int], token_ids: list[int], mask: list[int]) -> list[tuple[list[int], bool]]:
    """(ids, is a model turn) in order: the prompt, then the response's runs of equal mask."""
    out: list[tuple[list[int], bool]] = [(list(prompt_ids), False)]
    for token, model in zip(token_ids, mask):
        if out[-1][1] == bool(model) and (model or len(out) > 1):
            out[-1][0].append(token)
        else:
            out.append(([token], bool(model)))
    return out


def _first_text_difference(tokenizer: Any, ids: list[int], expected: str) -> int:
    """Index of the first token of `ids` whose text leaves `expected` (len(ids) when none does)."""
    for k in range(1, len(ids) + 1):
        if not expected.startswith(_decode(tokenizer, ids[:k])):
            return k - 1
    return len(ids)


def first_mismatch(tokenizer: Any, prompt_ids: list[int], token_ids: list[int], mask: list[int], expected: str,
                   closing: str = "") -> int | None:
    """The first position where prompt + response ids differ from `expected` (see the module docstring),
    or None. closing: the end-of-turn text that may follow the last turn in `expected` and not in the ids."""
    position, at = 0, 0
    for ids, model in _stretches(prompt_ids, token_ids, mask):
        text = _decode(tokenizer, ids)
        if expected[at:at + len(text)] != text:
            return position + _first_text_difference(tokenizer, ids, expected[at:])
        if not model:
            want = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if want != ids:
                return position + next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids),
                                                                                                     len(want)))
        at += len(text)
        position += len(ids)
    return None if expected[at:] in ("", closing) else position
