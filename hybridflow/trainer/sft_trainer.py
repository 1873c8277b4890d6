"""`SFTTrainer`: supervised fine-tuning on chat data, behind `hybridflow sft`.

    hybridflow sft --config recipes/sft.yaml model.path=MODEL_DIR data.train_files=chats.jsonl

A step takes `data.train_batch_size` conversations (`messages`, or `prompt` + `response`, from parquet
or jsonl; `hybridflow.data.SFTDataset`, rows made by `hybridflow.data.sft_data.collate_sft_rows`), and one
`SFTWorker` group (`hybridflow.workers.sft_worker`) trains on them with the FSDP2 `TrainEngine`: negative
log-likelihood on assistant tokens only, rows packed into token-budget micro-batches (`optim.use_packing`,
`optim.max_tokens_per_micro_batch`). Checkpoints, resume and the metric sinks are the RL trainer's; the
final model is written as a Hugging Face directory under `<trainer.output_dir>/hf`, ready for
`hybridflow train model.path=<that>`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from hybridflow.batch import Batch
from hybridflow.config.validate import validate_sft
from hybridflow.data.loader import BatchLoader
from hybridflow.data.sft_data import SFTDataset, collate_sft_rows
from hybridflow.tracking.metrics import compute_throughput, timer
from hybridflow.trainer.memory import sft_demand
from hybridflow.trainer.single_model import SingleModelTrainer
from hybridflow.workers.sft_worker import SFTWorker


class SFTTrainer(SingleModelTrainer[SFTWorker]):
    """Builds data, workers, checkpoints and loggers from an `SFTConfig` (the common parts in `Trainer` and
    `SingleModelTrainer`); `fit()` trains and exports."""

    model_role = "sft"

    def __init__(self, cfg: Any) -> None:
        validate_sft(cfg)
        super().__init__(cfg)

    @classmethod
    def build_loaders(cls, cfg: Any, tokenizer: Any) -> tuple[BatchLoader, BatchLoader | None]:
        data = cfg.data
        seed = data.seed if data.seed is not None else cfg.trainer.seed

        def dataset(files: list[str]) -> SFTDataset:
            return SFTDataset(files, tokenizer, data.messages_key, data.prompt_key, data.response_key, data.max_length,
                              data.truncation, data.text_key)

        train_ds = dataset(data.train_files)
        pad_id = train_ds.pad_token_id

        def collate(items: Sequence[Any], epoch: int) -> Batch:
            return collate_sft_rows(list(items), pad_id, epoch)

        train = BatchLoader(train_ds, data.train_batch_size, seed, data.shuffle, collate=collate)
        if not data.val_files:
            return train, None
        val_ds = dataset(data.val_files)
        return train, BatchLoader(val_ds, data.val_batch_size or len(val_ds), seed, shuffle=False, drop_last=False,
                                  collate=collate)

    def start_workers(self) -> None:
        cfg = self.cfg
        self.start_group(SFTWorker, SFTWorker.Config(model=cfg.model, optim=cfg.optim,
                                                     mini_batch_rows=cfg.optim.mini_batch_size,
                                                     total_steps=self.schedule_steps(), memory=sft_demand(cfg),
                                                     seed=cfg.trainer.seed))

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step (or `optim.passes_per_batch` x mini-batches) on a batch of conversations."""
        timings: dict[str, float] = {}
        with timer("step", timings):
            metrics = self.workers.train_batch(batch)
        metrics.update(compute_throughput(batch, timings["step"], self.n_devices))
        metrics["timing_s/step"] = timings["step"]
        self.bad_steps.update(self.step + 1, **{k: metrics[k] for k in ("train/loss", "train/grad_norm")})
        return metrics

    def validate(self) -> dict[str, float]:
        """`val/loss`: mean NLL per assistant token over the validation conversations."""
        start = time.perf_counter()
        nll = tokens = 0.0
        for batch in self.validation_batches():
            part = self.workers.eval_nll(batch)
            nll, tokens = nll + part["nll"], tokens + part["tokens"]
        return {"val/loss": nll / max(tokens, 1.0), "timing_s/val": time.perf_counter() - start}


def train_sft(cfg: Any) -> dict[str, float]:
    """Runs `hybridflow sft` for a loaded `SFTConfig`; returns the last step's metrics."""
    return SFTTrainer(cfg).fit()
