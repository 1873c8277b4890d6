"""`PreferenceDataset`: TRL-format preference pairs, and the rows a batch of pairs becomes.

A row holds a prompt and two completions of it, the preferred one and the other, under `prompt_key`,
`chosen_key` and `rejected_key` (default `prompt`, `chosen`, `rejected`), in either of TRL's formats:
- conversational: the prompt a list of chat messages, each completion a list of messages that continue it
  (usually one assistant message);
- plain: three strings.
A row without the prompt column has an implicit prompt, as TRL reads it: the start the two sides share
(`shared_prompt`).

How a side is tokenized depends on what trains on it (`encode`):
- a policy (`hybridflow dpo`, `encode_policy_pair`): the prompt as the policy sees it in an RL run: with
  the chat template (a plain prompt becomes a user turn, a plain completion an assistant turn), the
  completion's loss mask 1 on its assistant tokens (content and end-of-turn, as in SFT); with
  `apply_chat_template=False`, plain text (the tokenizer's BOS included), the completion followed by the
  eos token, every completion token in the loss.
- a reward model (`hybridflow rm`, `encode_scored_pair`): each side the text `ModelReward` scores in an RL
  run (`hybridflow.data.chat.render_scored_text`), read at its last token.

A pair whose longer side is over `max_length` tokens is refused (`truncation=error`, naming its file and
row) or dropped (`filter`). Pairs whose chosen and rejected sides are identical carry no preference (the
losses see a margin of 0 on them): they are counted and named in one warning, louder when every pair is one.
Batches keep one row per pair, so data-parallel dispatch never splits a pair (`collate_policy_pairs`,
`collate_scored_pairs`); in the worker, `policy_rows` / `scored_rows` lay them out as the training engine's rows
(docs/architecture.md), two per pair, chosen at 2i and rejected at 2i + 1:

    collate_policy_pairs (P pairs)                    policy_rows (2P rows, R = max(Rc, Rr))
    prompts, prompt_attention          [P, Lp] left-padded    input_ids, attention_mask, position_ids [2P, Lp+R]
    chosen, chosen_attention, chosen_mask [P, Rc] right-padded   response_mask [2P, R] float32 (the loss mask)
    rejected, rejected_attention, rejected_mask [P, Rr]          ref_logps [2P] (with ref_chosen/rejected_logps)

    collate_scored_pairs                                  scored_rows (2P rows)
    chosen, chosen_attention     [P, Lc] left-padded     input_ids, attention_mask, position_ids [2P, L+1]: the text,
    rejected, rejected_attention [P, Lr]                 then one pad token whose output position (the text's last
                                                         token) the score is read at; response_mask [2P, 1] = 1
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.config.preference_schema import PREFERENCE_TRUNCATION_MODES
from hybridflow.data.chat import (check_messages, encode_conversation, has_chat_template, render_messages,
                                  render_scored_text)
from hybridflow.data.dataset import RowDataset
from hybridflow.data.files import DataError, Record, as_path_list, read_records
from hybridflow.data.loader import left_pad

Side = str | list[dict]
logger = logging.getLogger(__name__)


def shared_prompt(chosen: Side, rejected: Side) -> tuple[Side, Side, Side]:
    """(prompt, chosen, rejected) of a pair whose prompt is implicit, TRL's way (`trl.extract_prompt`): the
    prompt is the longest shared start of the two sides (whole messages of message lists; characters of
    strings, where a space just before the first difference stays with the completions)."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if isinstance(chosen, str) and k and chosen[k - 1] == " ":
        k -= 1
    return chosen[:k], chosen[k:], rejected[k:]


def parse_sides(record: Record, prompt_key: str, side_keys: Sequence[str], implicit: bool = False) -> list[Side]:
    """[prompt, *sides] of a row, all strings or all message lists (TRL's standard and conversational
    formats); a `DataError` names the column. `implicit`: the row has no prompt column and the sides start
    with the prompt they share (`shared_prompt`; two sides)."""
    prompt: Any  # a row's values, checked below
    sides: list[Any]
    if implicit:
        prompt, *sides = shared_prompt(record.require(side_keys[0]), record.require(side_keys[1]))
        where = f"{prompt_key} (the start '{side_keys[0]}' and '{side_keys[1]}' share, as the row has no " \
                f"'{prompt_key}' column)"
    else:
        prompt, sides = record.require(prompt_key), [record.require(k) for k in side_keys]
        where = prompt_key
    conversational = not isinstance(prompt, str)
    if conversational:
        problem = check_messages(prompt)
        if problem is not None:
            raise record.error(where, f"a non-empty string or {problem}", prompt)
    elif not prompt.strip():
        raise record.error(where, "a non-empty prompt", prompt)
    for key, value in zip(side_keys, sides):
        if conversational:
            problem = check_messages(value)
            if problem is not None:
                raise record.error(key, f"{problem} continuing the prompt (the prompt '{prompt_key}' is a message "
                                        f"list, so completions are too: TRL's conversational format)", value)
            if not any(m["role"] == "assistant" for m in value):
                raise record.error(key, "at least one assistant message", show_value=False)
        elif not isinstance(value, str) or not value.strip():
            raise record.error(key, f"a non-empty string (the prompt '{prompt_key}' is a string: TRL's plain "
                                    f"format)", value)
    return [prompt, *sides]


def parse_pair(record: Record, prompt_key: str, chosen_key: str, rejected_key: str) -> tuple[Side, Side, Side]:
    """(prompt, chosen, rejected) of a row, with an explicit prompt or an implicit one (a row without
    `prompt_key`: `shared_prompt`); a `DataError` names the column and the key that maps it."""
    record.require(chosen_key, "data.chosen_key")
    record.require(rejected_key, "data.rejected_key")
    prompt, chosen, rejected = parse_sides(record, prompt_key, (chosen_key, rejected_key),
                                           implicit=prompt_key not in record.data)
    return prompt, chosen, rejected


def _as_messages(prompt: Side, completion: Side) -> tuple[list[dict], list[dict]]:
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]
    if isinstance(prompt, str) or isinstance(completion, str):
        raise TypeError("a preference pair's sides are all strings or all message lists (parse_pair checks it)")
    return ([{"role": m["role"], "content": m["content"]} for m in prompt],
            [{"role": m["role"], "content": m["content"]} for m in completion])


def encode_policy_side(prompt: Side, completion: Side, tokenizer: Any,
                       apply_chat_template: bool) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, completion loss mask) of one side for a policy (see the module docstring).
    Raises `ValueError` when the rendered prompt is not a token prefix of prompt + completion."""
    if not apply_chat_template:
        if not isinstance(prompt, str):
            raise ValueError("conversational pairs need data.apply_chat_template=true")
        if tokenizer.eos_token_id is None:
            raise ValueError("plain completions end with the eos token, and the tokenizer has none")
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        return prompt_ids, ids, [1] * len(ids)
    if not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template; set data.apply_chat_template=false to train on "
                         "plain text")
    prompt_msgs, completion_msgs = _as_messages(prompt, completion)
    text = render_messages(prompt_msgs, tokenizer, add_generation_prompt=True)
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids, mask = encode_conversation(prompt_msgs + completion_msgs, tokenizer)
    if ids[:len(prompt_ids)] != prompt_ids:
        raise ValueError("the tokens of the rendered prompt are not a prefix of the tokens of prompt + completion "
                         "(the tokenizer merges across their boundary)")
    return prompt_ids, ids[len(prompt_ids):], mask[len(prompt_ids):]


def encode_policy_pair(prompt: Side, chosen: Side, rejected: Side, tokenizer: Any,
                       apply_chat_template: bool = True) -> dict[str, list[int]]:
    """A policy's item: `prompt_ids`, and `chosen_ids` / `chosen_mask` / `rejected_ids` / `rejected_mask`."""
    item: dict[str, list[int]] = {}
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        prompt_ids, ids, mask = encode_policy_side(prompt, completion, tokenizer, apply_chat_template)
        if item.setdefault("prompt_ids", prompt_ids) != prompt_ids:
            raise ValueError("the prompt tokenizes differently before the chosen and the rejected completion")
        if not any(mask):
            raise ValueError(f"the {name} completion has no assistant token to score")
        item[f"{name}_ids"], item[f"{name}_mask"] = ids, mask
    return item


def encode_scored_pair(prompt: Side, chosen: Side, rejected: Side, tokenizer: Any) -> dict[str, list[int]]:
    """A reward model's item: `chosen_ids` and `rejected_ids`, each the whole text `ModelReward` scores."""
    return {f"{name}_ids": list(tokenizer(render_scored_text(prompt, side, tokenizer),
                                          add_special_tokens=False)["input_ids"])
            for name, side in (("chosen", chosen), ("rejected", rejected))}


def pair_length(item: dict[str, list[int]]) -> int:
    """Tokens of the longer side of an item (prompt included)."""
    return len(item.get("prompt_ids", ())) + max(len(item["chosen_ids"]), len(item["rejected_ids"]))


class PreferenceDataset(RowDataset):
    """Tokenized preference pairs; `ds[i]` is `encode`'s item of row i plus its `index`.

    Args:
        files: one path or a list (.parquet or .jsonl).
        tokenizer: a Hugging Face tokenizer.
        encode: `encode(prompt, chosen, rejected) -> item` (`encode_policy_pair` or `encode_scored_pair`
            with the tokenizer bound); a `ValueError` it raises is reported with the file and row.
        max_length: most tokens of a side (prompt included); `None` = no limit.
        truncation: `error` | `filter` for pairs over `max_length`.
    """

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any,
                 encode: Callable[[Side, Side, Side], dict[str, list[int]]], prompt_key: str = "prompt",
                 chosen_key: str = "chosen", rejected_key: str = "rejected", max_length: int | None = None,
                 truncation: str = "error") -> None:
        if truncation not in PREFERENCE_TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r}; valid: {', '.join(PREFERENCE_TRUNCATION_MODES)}")
        self.files = as_path_list(files)
        self.tokenizer = tokenizer
        self.num_filtered = 0
        self._rows: list[dict[str, list[int]]] = []
        records = read_records(self.files)
        identical: list[Record] = []
        for record in records:
            prompt, chosen, rejected = parse_pair(record, prompt_key, chosen_key, rejected_key)
            if chosen == rejected:
                identical.append(record)
            try:
                item = encode(prompt, chosen, rejected)
            except ValueError as e:
                raise DataError(f"{record.where}: {e}") from None
            if max_length is not None and pair_length(item) > max_length:
                if truncation == "error":
                    raise DataError(f"{record.where}: {pair_length(item)} tokens in its longer side, over "
                                    f"max_length={max_length}; set truncation to filter or raise max_length")
                self.num_filtered += 1
                continue
            self._rows.append(item)
        self.num_rows = len(records)
        self.num_identical = len(identical)
        if identical:
            logger.warning("%s: %s pairs have the chosen side identical to the rejected one (first: %s): they carry "
                           "no preference%s", ", ".join(self.files),
                           f"all {self.num_rows}" if len(identical) == self.num_rows
                           else f"{len(identical)} of {self.num_rows}", identical[0].where,
                           "; the run cannot learn from this data: check the chosen / rejected columns "
                           f"('{chosen_key}', '{rejected_key}')" if len(identical) == self.num_rows else "")
        if not self._rows:
            raise DataError(f"{', '.join(self.files)}: no preference pairs left ({self.num_rows} read, "
                            f"{self.num_filtered} over max_length)")


def right_pad(rows: Sequence[Sequence[int]], pad: int | float, dtype: torch.dtype = torch.long
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values [B, W], mask [B, W])`: rows left-aligned, padded on the right with `pad` to the longest."""
    width = max((len(r) for r in rows), default=0)
    values = torch.full((len(rows), width), pad, dtype=dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        values[i, :len(r)] = torch.as_tensor(r, dtype=dtype)
        mask[i, :len(r)] = 1
    return values, mask


def collate_policy_pairs(items: Sequence[dict[str, Any]], pad_id: int, epoch: int = 0) -> Batch:
    """One row per pair of `encode_policy_pair` items (keys in the module docstring)."""
    prompts, prompt_attention = left_pad([it["prompt_ids"] for it in items], pad_id)
    tensors = {"prompts": prompts, "prompt_attention": prompt_attention}
    for side in ("chosen", "rejected"):
        tensors[side], tensors[f"{side}_attention"] = right_pad([it[f"{side}_ids"] for it in items], pad_id)
        tensors[f"{side}_mask"] = right_pad([it[f"{side}_mask"] for it in items], 0.0, torch.float32)[0]
    return Batch(tensors, {"index": [it["index"] for it in items]}, {"epoch": epoch})


def collate_scored_pairs(items: Sequence[dict[str, Any]], pad_id: int, epoch: int = 0) -> Batch:
    """One row per pair of `encode_scored_pair` items (keys in the module docstring)."""
    tensors = {}
    for side in ("chosen", "rejected"):
        tensors[side], tensors[f"{side}_attention"] = left_pad([it[f"{side}_ids"] for it in items], pad_id)
    return Batch(tensors, {"index": [it["index"] for it in items]}, {"epoch": epoch})


def pair_tokens(batch: Batch) -> float:
    """Real tokens of every sequence of a collated batch of pairs (a policy's prompt counted on both sides)."""
    tokens = float(batch["chosen_attention"].sum() + batch["rejected_attention"].sum())
    return tokens + 2 * float(batch["prompt_attention"].sum()) if "prompt_attention" in batch else tokens


def _interleave(chosen: torch.Tensor, rejected: torch.Tensor, width: int, value: int | float, left: bool
                ) -> torch.Tensor:
    """`[2P, width]`: row 2i = chosen[i], row 2i + 1 = rejected[i], each padded with `value` to `width`."""
    padded = [torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)
              for t in (chosen, rejected)]
    return torch.stack(padded, dim=1).flatten(0, 1)


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor) -> dict:
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "response_mask": response_mask}


def policy_rows(pairs: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """The engine's rows of a `collate_policy_pairs` batch (module docstring); `ref_logps` when the batch
    has the reference's `ref_chosen_logps` / `ref_rejected_logps`."""
    width = max(pairs["chosen"].shape[1], pairs["rejected"].shape[1])
    completion = _interleave(pairs["chosen"], pairs["rejected"], width, pad_id, left=False)
    attention = _interleave(pairs["chosen_attention"], pairs["rejected_attention"], width, 0, left=False)
    rows = _rows(torch.cat([pairs["prompts"].repeat_interleave(2, 0), completion], 1),
                 torch.cat([pairs["prompt_attention"].repeat_interleave(2, 0), attention], 1),
                 _interleave(pairs["chosen_mask"], pairs["rejected_mask"], width, 0.0, left=False))
    if "ref_chosen_logps" in pairs:
        rows["ref_logps"] = torch.stack([pairs["ref_chosen_logps"], pairs["ref_rejected_logps"]], 1).flatten()
    return rows


def scored_rows(pairs: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """The engine's rows of a `collate_scored_pairs` batch (module docstring)."""
    width = max(pairs["chosen"].shape[1], pairs["rejected"].shape[1])
    text = _interleave(pairs["chosen"], pairs["rejected"], width, pad_id, left=True)
    attention = _interleave(pairs["chosen_attention"], pairs["rejected_attention"], width, 0, left=True)
    last = torch.ones(text.shape[0], 1, dtype=torch.long)
    return _rows(torch.cat([text, last * pad_id], 1), torch.cat([attention, last], 1), last.float())
