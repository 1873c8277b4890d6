"""`BatchLoader`: seeded, resumable batches of a dataset, as `hybridflow.batch.Batch` objects.

The order of epoch `e` is a permutation drawn from `(seed, e)` alone, so it does not depend on what
ran before; the loader's state is `(epoch, position)` (batches already taken in that epoch), and
`load_state_dict(state_dict())` continues with exactly the next batch. The loader serves any dataset
through its `collate` (the SFT trainer's conversations, for one); by default it makes prompt batches,
left-padded:

    prompts         [B, P] long   token ids, left-padded with the pad id (P = longest prompt in batch)
    attention_mask  [B, P] long   1 on real tokens
    pixel_values    [B, patches, D], image_grid_thw [B, images, 3+]: a vision model's images (`VisionInputs.pad_rows`)
    non-tensors     uid ("<epoch>-<index>"), index, data_source, ground_truth, extra_info, raw_prompt, ability,
                    columns (the row's dataset columns but the prompt)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.batch import Batch
from hybridflow.data.dataset import RLDataset
from hybridflow.data.files import DataError
from hybridflow.data.image_prompts import VisionInputs, VisionPrompts

PROMPT_FIELDS = ("index", "data_source", "ground_truth", "extra_info", "raw_prompt", "ability", "columns")


def left_pad(rows: Sequence[Sequence[int] | np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids [B, P], mask [B, P])`: rows right-aligned to the longest, padded on the left with `pad_id`."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max(initial=0))
    mask = np.arange(width) >= (width - lengths)[:, None]
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    if width:
        ids[mask] = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


def collate_prompts(items: Sequence[dict[str, Any]], pad_id: int, epoch: int) -> Batch:
    """A prompt `Batch` (see the module docstring) from `RLDataset` items."""
    ids, mask = left_pad([it["input_ids"] for it in items], pad_id)
    non_tensors: dict[str, list] = {"uid": [f"{epoch}-{it['index']}" for it in items]}
    non_tensors.update({k: [it[k] for it in items] for k in PROMPT_FIELDS})
    tensors = {"prompts": ids, "attention_mask": mask}
    if any("vision" in it for it in items):  # a vision model's rows: their images as batch tensors
        tensors.update(VisionInputs.pad_rows([it.get("vision") for it in items]))
    return Batch(tensors, non_tensors, {"epoch": epoch})


class BatchLoader:
    """Batches of `dataset` in a seeded order per epoch, with a checkpointable position.

    Args:
        dataset: anything with `len()` and `[i]` (an `RLDataset`, an `SFTDataset`).
        batch_size: rows per batch.
        seed: the shuffling seed.
        shuffle: a new seeded permutation each epoch; else the file order.
        drop_last: drop the last incomplete batch of an epoch.
        collate: `collate(items, epoch) -> Batch`; default: `collate_prompts` with the dataset's pad id.

    `iter(loader)` yields the rest of the current epoch and then moves to the next one, so
    `for epoch in ...: for batch in loader:` works; `next_batch()` crosses epochs by itself.
    """

    def __init__(self, dataset: Any, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 collate: Callable[[Sequence[Any], int], Batch] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if drop_last and batch_size > len(dataset):
            raise ValueError(f"batch_size={batch_size} is larger than the dataset ({len(dataset)} rows), so "
                             f"drop_last leaves no batch; use a batch size <= {len(dataset)}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        if collate is None:
            pad_id = dataset.pad_token_id

            def collate(items: Sequence[Any], epoch: int) -> Batch:
                return collate_prompts(items, pad_id, epoch)
        self.collate = collate
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The dataset indices of `epoch` in the order they are served."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def batch_at(self, epoch: int, position: int) -> Batch:
        """Batch number `position` of `epoch` (does not move the loader)."""
        idx = self.order(epoch)[position * self.batch_size:(position + 1) * self.batch_size]
        return self.collate([self.dataset[int(i)] for i in idx], epoch)

    def next_batch(self) -> Batch:
        """The next batch, moving to the next epoch when this one is used up."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        batch = self.batch_at(self.epoch, self.position)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while self.position < len(self):
            yield self.next_batch()
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int | bool]:
        """`{"epoch", "position", "seed", "batch_size", "shuffle"}`: enough to continue exactly."""
        epoch, position = (self.epoch + 1, 0) if self.position >= len(self) else (self.epoch, self.position)
        return {"epoch": epoch, "position": position, "seed": self.seed, "batch_size": self.batch_size,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Continues from `state`; a different batch size would shift every batch, so it is refused."""
        if state["batch_size"] != self.batch_size:
            raise ValueError(f"the saved loader state has batch_size={state['batch_size']}, this loader "
                             f"{self.batch_size}; resume with the same data.train_batch_size")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"saved position {state['position']} is outside an epoch of {len(self)} batches")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def image_prompts(cfg: Any, tokenizer: Any) -> tuple[str, VisionPrompts] | None:
    """`(data.image_key, VisionPrompts)` of a vision-language model's run; None for a text model. An image key on a
    text model is refused."""
    key, path = cfg.data.image_key, cfg.model.path
    if key is None:  # a vision-language model without it is refused before (`input_checks.vision_problems`)
        return None
    try:
        return key, VisionPrompts.from_pretrained(path, tokenizer)
    except ValueError as e:  # not a vision-language model
        raise DataError(f"data.image_key={key}: {e}") from None


def build_prompt_loaders(cfg: Any, tokenizer: Any,
                         tools: list[dict] | None = None) -> tuple[BatchLoader, BatchLoader | None]:
    """`(train, val)` loaders from an `RLConfig`'s `data` (and `trainer.seed`); val is None without files.

    Validation batches keep the file order, keep every row, and hold `data.val_batch_size` prompts
    (all of them when null). `tools`: function schemas rendered into every prompt.
    """
    data = cfg.data
    images = image_prompts(cfg, tokenizer)

    def dataset(files: list[str]) -> RLDataset:
        return RLDataset(files, tokenizer, data.prompt_key, data.max_prompt_length, data.truncation,
                         data.apply_chat_template, tools, images)

    seed = data.seed if data.seed is not None else cfg.trainer.seed
    train_ds = dataset(data.train_files)
    if data.train_batch_size > len(train_ds):
        raise DataError(f"{', '.join(train_ds.files)}: {len(train_ds)} prompts, fewer than one step's "
                        f"data.train_batch_size={data.train_batch_size}; use data.train_batch_size <= {len(train_ds)}")
    train = BatchLoader(train_ds, data.train_batch_size, seed, shuffle=data.shuffle)
    if not data.val_files:
        return train, None
    val_ds = dataset(data.val_files)
    val = BatchLoader(val_ds, data.val_batch_size or len(val_ds), seed, shuffle=False, drop_last=False)
    return train, val
