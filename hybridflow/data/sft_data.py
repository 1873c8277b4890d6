"""`SFTDataset` (rows in TRL's SFT formats, with a loss mask on the tokens learnt) and the packing collator.

A row is in one of TRL's formats, found by its columns, in this order:
- a conversation under `messages_key` (a list of `{role, content}`), rendered with the chat template, the
  loss on every assistant turn (content and end-of-turn);
- a prompt and a completion under `prompt_key` / `response_key` (default `prompt` / `completion`), both
  strings (a user and an assistant message) or both message lists (TRL's conversational prompt/completion:
  the completion continues the prompt's messages), rendered with the chat template, the loss on the
  completion's assistant tokens only (TRL's completion-only loss; the prompt's turns are context); either key
  may be a dotted path to a field of a dict column (`extra_info.question`, verl's `prompt_dict_keys`);
- plain text under `text_key` (TRL's language-modeling format), tokenized as it is (the tokenizer's BOS
  included) and followed by the eos token, the loss on every token.
`loss_mask[t] = 1` on the tokens trained as targets (token t is predicted from t-1).

`PackingCollator(max_tokens)` concatenates rows into packs of at most `max_tokens` tokens (first-fit
decreasing), each row keeping its own position ids, so no compute is spent on padding:

    input_ids     [K, W] long     K packs, W = longest pack (<= max_tokens), right-padded with pad id
    position_ids  [K, W] long     0.. within each row, 0 on padding
    loss_mask     [K, W] float32  1.0 on assistant tokens
    segment_ids   [K, W] long     1, 2, ... per row inside a pack, 0 on padding (for varlen attention)
    attention_mask [K, W] long    1 on real tokens

`collate_sft_rows` makes the rows the training engine takes instead, one conversation per row,
right-padded, as "prompt" = the first token and "response" = the rest:

    input_ids       [B, W]    long     conversation tokens, right-padded with the pad id
    attention_mask  [B, W]    long     1 on real tokens
    position_ids    [B, W]    long     0.. per row
    response_mask   [B, W-1]  float32  the loss mask of tokens 1..W-1 (1.0 on assistant tokens)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.config.sft_schema import SFT_TRUNCATION_MODES
from hybridflow.data.chat import check_messages, encode_conversation, has_chat_template
from hybridflow.data.dataset import RowDataset
from hybridflow.data.files import DataError, Record, as_path_list, read_records
from hybridflow.data.preference_data import encode_policy_side, parse_sides

def _has_template(tokenizer: Any, record: Record) -> None:
    if not has_chat_template(tokenizer):
        raise DataError(f"{record.where}: a conversation or prompt/completion row needs a tokenizer with a chat "
                        f"template, and this one has none (a 'text' row trains on plain text)")


def encode_row(record: Record, tokenizer: Any, messages_key: str, prompt_key: str, response_key: str,
               text_key: str) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)` of a row in any of the formats of the module docstring; a `DataError` names the
    row, the column, and the key that maps a column it lacks."""
    data = record.data
    if messages_key in data:
        _has_template(tokenizer, record)
        messages = data[messages_key]
        problem = check_messages(messages)
        if problem is not None:
            raise record.error(messages_key, problem, messages)
        if not any(m["role"] == "assistant" for m in messages):
            raise record.error(messages_key, "at least one assistant message to learn from", show_value=False)
        return encode_conversation([{"role": m["role"], "content": m["content"]} for m in messages], tokenizer)
    if record.has(prompt_key) or record.has(response_key):
        record.require(prompt_key, "data.prompt_key")
        record.require(response_key, "data.response_key")
        _has_template(tokenizer, record)
        prompt, completion = parse_sides(record, prompt_key, (response_key,))
        try:
            prompt_ids, ids, mask = encode_policy_side(prompt, completion, tokenizer, apply_chat_template=True)
        except ValueError as e:
            raise DataError(f"{record.where}: {e}") from None
        return prompt_ids + ids, [0] * len(prompt_ids) + mask
    if text_key in data:
        text = data[text_key]
        if not isinstance(text, str) or not text.strip():
            raise record.error(text_key, "a non-empty string", text)
        if tokenizer.eos_token_id is None:
            raise DataError(f"{record.where}: a '{text_key}' row ends with the eos token, and the tokenizer has none")
        ids = list(tokenizer(text)["input_ids"]) + [tokenizer.eos_token_id]
        return ids, [1] * len(ids)
    raise DataError(f"{record.where}: no column to learn from: a conversation under '{messages_key}' "
                    f"(data.messages_key), a prompt and a completion under '{prompt_key}' and '{response_key}' "
                    f"(data.prompt_key, data.response_key) or text under '{text_key}' (data.text_key); set the key "
                    f"that names yours. Columns: {', '.join(data) or 'none'}")


class SFTDataset(RowDataset):
    """Tokenized rows; `ds[i]` is `{"input_ids": list[int], "loss_mask": list[int], "index": i}`.

    Args:
        files: one path or a list (.parquet or .jsonl).
        tokenizer: a Hugging Face tokenizer (with a chat template for conversation and prompt/completion rows).
        messages_key, prompt_key, response_key, text_key: the columns of each format (module docstring).
        max_length: longest row in tokens; `None` = no limit.
        truncation: `error` | `filter` | `right` (keep the first max_length tokens).
    """

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any, messages_key: str = "messages",
                 prompt_key: str = "prompt", response_key: str = "completion", max_length: int | None = None,
                 truncation: str = "error", text_key: str = "text") -> None:
        if truncation not in SFT_TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r}; valid: {', '.join(SFT_TRUNCATION_MODES)}")
        self.files = as_path_list(files)
        self.tokenizer = tokenizer
        self.num_filtered = self.num_truncated = 0
        self._rows: list[dict[str, list[int]]] = []
        records = read_records(self.files)
        for record in records:
            ids, mask = encode_row(record, tokenizer, messages_key, prompt_key, response_key, text_key)
            if max_length is not None and len(ids) > max_length:
                if truncation == "error":
                    raise DataError(f"{record.where}: {len(ids)} tokens, over max_length={max_length}; set "
                                    f"truncation to filter or right, or raise max_length")
                if truncation == "filter":
                    self.num_filtered += 1
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
                self.num_truncated += 1
            self._rows.append({"input_ids": ids, "loss_mask": mask})
        self.num_rows = len(records)
        if not self._rows:
            raise DataError(f"{', '.join(self.files)}: no conversations left ({self.num_rows} read, "
                            f"{self.num_filtered} over max_length)")


def pack_lengths(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Groups row indices into packs whose lengths sum to at most `max_tokens` (first-fit decreasing).

    Rows keep their input order inside a pack; a row longer than `max_tokens` is refused.
    """
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        raise ValueError(f"row {too_long[0]} has {lengths[too_long[0]]} tokens, over the packing budget "
                         f"max_tokens={max_tokens}")
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((p for p, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            packs.append([])
            room.append(max_tokens)
            slot = len(packs) - 1
        packs[slot].append(i)
        room[slot] -= lengths[i]
    return [sorted(p) for p in packs]


class PackingCollator:
    """`collator(items, epoch=0) -> Batch` of packed rows (see the module docstring for the keys)."""

    def __init__(self, max_tokens: int, pad_token_id: int) -> None:
        self.max_tokens, self.pad_token_id = max_tokens, pad_token_id

    def __call__(self, items: Sequence[dict[str, Any]], epoch: int = 0) -> Batch:
        packs = pack_lengths([len(it["input_ids"]) for it in items], self.max_tokens)
        width = max(sum(len(items[i]["input_ids"]) for i in p) for p in packs)
        shape = (len(packs), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.float32)
        segment_ids = torch.zeros(shape, dtype=torch.long)
        for k, pack in enumerate(packs):
            start = 0
            for seg, i in enumerate(pack, start=1):
                ids = items[i]["input_ids"]
                end = start + len(ids)
                input_ids[k, start:end] = torch.as_tensor(ids, dtype=torch.long)
                position_ids[k, start:end] = torch.arange(len(ids))
                loss_mask[k, start:end] = torch.as_tensor(items[i]["loss_mask"], dtype=torch.float32)
                segment_ids[k, start:end] = seg
                start = end
        return Batch(
            {"input_ids": input_ids, "position_ids": position_ids, "loss_mask": loss_mask,
             "segment_ids": segment_ids, "attention_mask": (segment_ids > 0).long()},
            {"index": [[items[i]["index"] for i in p] for p in packs]},
            {"epoch": epoch, "num_sequences": len(items)},
        )


def collate_sft_rows(items: list[dict[str, Any]], pad_id: int, epoch: int = 0) -> Batch:
    """A `Batch` of right-padded conversations (keys in the module docstring) from `SFTDataset` items."""
    lengths = [len(it["input_ids"]) for it in items]
    width = max(max(lengths), 2)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(items), width, dtype=torch.float32)
    for i, it in enumerate(items):
        input_ids[i, :lengths[i]] = torch.as_tensor(it["input_ids"], dtype=torch.long)
        loss_mask[i, :lengths[i]] = torch.as_tensor(it["loss_mask"], dtype=torch.float32)
    attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "response_mask": loss_mask[:, 1:].contiguous()},
                 {"index": [it["index"] for it in items]}, {"epoch": epoch})
