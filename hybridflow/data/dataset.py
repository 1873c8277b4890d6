"""`RLDataset`: prompts for RL training and validation, read from verl-format parquet or jsonl.

A row has the prompt under `prompt_key` (a list of chat messages `{role, content}` or a plain string)
and optionally `data_source` (str; routes `reward.function=auto`), `ability` (str), `reward_model`
(a mapping with `ground_truth`; a top-level `ground_truth` column works too) and `extra_info` (a
mapping, passed to the reward function); every column is kept for batched (TRL-style) reward functions. Every row is checked and tokenized when the dataset is built,
so a malformed file or row is refused before training, with the file, row and column named. A vision-language
model's rows also hold images (`data.image_key`, `image_prompts`), decoded and checked here too.

Prompts longer than `max_prompt_length` tokens are handled by `truncation`: `error` refuses the
dataset, `filter` drops them, `left` / `right` keep the last / first tokens; the counts are logged and
kept in `num_filtered` / `num_truncated`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.config.schema import TRUNCATION_MODES
from hybridflow.data.chat import check_messages, encode_prompts, pad_token_id
from hybridflow.data.files import DataError, Record, as_path_list, read_records
from hybridflow.data.image_prompts import VisionPrompts

logger = logging.getLogger(__name__)

DEFAULT_DATA_SOURCE = "unknown"
CARRIED = ("data_source", "ability", "extra_info")  # columns a row carries as fields of its own


def _check_prompt(record: Record, prompt_key: str) -> str | list[dict]:
    prompt = record.require(prompt_key, "data.prompt_key")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise record.error(prompt_key, "a non-empty prompt", prompt)
        return prompt
    problem = check_messages(prompt)
    if problem is not None:
        raise record.error(prompt_key, f"a non-empty string or {problem}", prompt)
    return prompt


def _optional(record: Record, column: str, kind: type, default: Any) -> Any:
    value = record.data.get(column)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise record.error(column, f"{'a mapping' if kind is dict else kind.__name__} or null", value)
    return value


def parse_row(record: Record, prompt_key: str = "prompt") -> dict[str, Any]:
    """The checked fields of one verl-format row: raw_prompt, data_source, ability, ground_truth, extra_info,
    and `columns`, the row's other columns as read (batched reward functions get them all: these and the
    fields, which are not copied into `columns`)."""
    reward_model = _optional(record, "reward_model", dict, None)
    if reward_model is not None:
        ground_truth = reward_model.get("ground_truth")
    else:
        ground_truth = record.data.get("ground_truth")
    return {
        "raw_prompt": _check_prompt(record, prompt_key),
        "data_source": _optional(record, "data_source", str, DEFAULT_DATA_SOURCE),
        "ability": _optional(record, "ability", str, ""),
        "ground_truth": ground_truth,
        "extra_info": _optional(record, "extra_info", dict, {}),
        "columns": {k: v for k, v in record.data.items() if k not in (prompt_key, *CARRIED)},
    }


class RowDataset:
    """What every dataset here serves: its checked rows (`self._rows`, dicts) by position, each with its
    `index`, and the pad id of its `self.tokenizer`."""

    _rows: list[dict[str, Any]]
    tokenizer: Any

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self._rows[index], "index": index}

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id (its eos id when it has none)."""
        return pad_token_id(self.tokenizer)


class RLDataset(RowDataset):
    """Checked, tokenized prompts; `ds[i]` is a dict with `input_ids` (1-D int64 numpy array), the
    row's fields (`raw_prompt`, `data_source`, `ability`, `ground_truth`, `extra_info`) and `index`.

    Args:
        files: one path or a list (.parquet or .jsonl).
        tokenizer: a Hugging Face tokenizer (its chat template renders message prompts).
        prompt_key: the column holding the prompt.
        max_prompt_length: longest prompt in tokens; `None` = no limit.
        truncation: `error` | `filter` | `left` | `right` for prompts over the limit.
        apply_chat_template: render prompts with the tokenizer's chat template.
        tools: function schemas shown in every prompt (multi-turn runs with `agent.tools`).
        images: a vision-language model's `(image_key, VisionPrompts)`: each row's images under that column, encoded
            with its prompt (`image_prompts`); a row then also has `vision` (its `VisionInputs`).
    """

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any, prompt_key: str = "prompt",
                 max_prompt_length: int | None = None, truncation: str = "error",
                 apply_chat_template: bool = True, tools: list[dict] | None = None,
                 images: tuple[str, VisionPrompts] | None = None) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r}; valid: {', '.join(TRUNCATION_MODES)}")
        self.files = as_path_list(files)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        records = read_records(self.files)
        if not records:
            raise DataError(f"{', '.join(self.files)}: no rows")
        rows = [parse_row(r, prompt_key) for r in records]
        self.sources: dict[str, str] = {}  # each data source -> the first row with it ("file, row i")
        for record, row in zip(records, rows):
            null = " (data_source is null or missing)" if record.data.get("data_source") is None else ""
            self.sources.setdefault(row["data_source"], record.where + null)
        if images is not None:
            ids = self._encode_images(records, rows, images, apply_chat_template, tools, truncation)
        else:
            try:
                ids = encode_prompts([row["raw_prompt"] for row in rows], tokenizer, apply_chat_template, tools)
            except ValueError as e:
                raise DataError(f"{self.files[0]}, column '{prompt_key}': {e}") from None
        self.num_rows = len(rows)
        self._rows = self._limit_lengths(records, rows, ids, prompt_key, truncation)

    @staticmethod
    def _encode_images(records: list[Record], rows: list[dict], images: tuple[str, VisionPrompts],
                       apply_chat_template: bool, tools: list[dict] | None, truncation: str) -> list[list[int]]:
        """Each row's token ids with its images' vision tokens; its `VisionInputs` kept as the row's `vision`. A bad
        image or placeholder count is refused naming the file, row and image."""
        key, prompts = images
        if tools:
            raise DataError(f"{records[0].where}: tool schemas with images in the prompts are not supported")
        if truncation in ("left", "right"):
            raise DataError(f"data.truncation={truncation} would cut image tokens out of a prompt; use error or "
                            f"filter with data.image_key={key}")
        ids = []
        for record, row in zip(records, rows):
            try:
                row_ids, row["vision"] = prompts.encode(row["raw_prompt"], record.require(key, "data.image_key"),
                                                        record.where, apply_chat_template)
            except ValueError as e:
                raise e if isinstance(e, DataError) else DataError(str(e)) from None
            row["columns"].pop(key, None)  # the pixels travel as `vision`; reward functions need not get the bytes
            ids.append(row_ids)
        return ids

    def _limit_lengths(self, records: list[Record], rows: list[dict], ids: list[list[int]], prompt_key: str,
                       truncation: str) -> list[dict[str, Any]]:
        """The rows with their token ids, after refusing, dropping or cutting prompts over the limit."""
        limit, kept, too_long = self.max_prompt_length, [], []
        for record, row, row_ids in zip(records, rows, ids):
            if limit is not None and len(row_ids) > limit:
                too_long.append((record, len(row_ids)))
                if truncation == "filter":
                    continue
                row_ids = row_ids[-limit:] if truncation == "left" else row_ids[:limit]
            if not row_ids:
                raise record.error(prompt_key, "a prompt that tokenizes to at least one token", show_value=False)
            kept.append({**row, "input_ids": np.asarray(row_ids, dtype=np.int64)})
        if too_long and truncation == "error":
            record, length = too_long[0]
            raise DataError(
                f"{len(too_long)} of {self.num_rows} prompts are longer than max_prompt_length={limit} "
                f"tokens (first: {record.where}, {length} tokens); set data.truncation=filter to drop them, "
                f"left/right to cut them, or raise data.max_prompt_length")
        self.num_filtered = len(too_long) if truncation == "filter" else 0
        self.num_truncated = len(too_long) if truncation in ("left", "right") else 0
        if not kept:
            raise DataError(f"{', '.join(self.files)}: all {self.num_rows} prompts are longer than "
                            f"max_prompt_length={limit}")
        level = logging.WARNING if too_long else logging.INFO  # dropped or cut data is worth seeing
        logger.log(level, "%s: %d prompts (%d read, %d filtered, %d truncated; max_prompt_length=%s)",
                   ", ".join(self.files), len(kept), self.num_rows, self.num_filtered, self.num_truncated, limit)
        return kept
