"""`SFTTrainer`: supervised fine-tuning on chat data, behind `hybridflow sft`.

    hybridflow sft --config recipes/sft.yaml model.path=MODEL_DIR data.train_files=chats.jsonl

A step takes `data.train_batch_size` conversations (`messages`, or `prompt` + `response`, from parquet
or jsonl; `hybridflow.data.SFTDataset`, rows made by `hybridflow.data.sft.collate_sft_rows`), and one
`SFTWorker` group (`hybridflow.workers.sft`) trains on them with the FSDP2 `TrainEngine`: negative
log-likelihood on assistant tokens only, rows packed into token-budget micro-batches (`optim.use_packing`,
`optim.max_tokens_per_micro_batch`). Checkpoints, resume and the metric sinks are the RL trainer's; the
final model is written as a Hugging Face directory under `<trainer.output_dir>/hf`, ready for
`hybridflow train model.path=<that>`.
"""

from __future__ import annotations

import time
from typing import Any

from hybridflow.batch import Batch
from hybridflow.checkpoint import BadStepCounter, check_writable, export_hf
from hybridflow.config.validate import validate_sft
from hybridflow.controller import WorkerGroup
from hybridflow.data.loader import BatchLoader
from hybridflow.data.sft import SFTDataset, collate_sft_rows
from hybridflow.tracking import Tracker
from hybridflow.tracking.metrics import compute_throughput, timer
from hybridflow.trainer.checkpointing import RunCheckpoints
from hybridflow.trainer.loop import run_steps
from hybridflow.trainer.roles import device_type
from hybridflow.workers.sft import SFTWorker


class SFTCheckpoints(RunCheckpoints):
    """The RL run's checkpoints (atomic, resumable, exportable) holding the SFT model as role `actor`."""

    def stateful(self) -> dict[str, Any]:
        return {"data": self.trainer.train_loader, "bad_steps": self.trainer.bad_steps}

    def roles(self) -> dict[str, Any]:
        return {"actor": self.trainer.worker}


# ---------------------------------------------------------------------- the loop
class SFTTrainer:
    """Builds data, workers, checkpoints and loggers from an `SFTConfig`; `fit()` trains and exports."""

    def __init__(self, cfg: Any) -> None:
        from transformers import AutoTokenizer

        validate_sft(cfg)
        self.cfg = cfg
        self.output_dir = check_writable(cfg.trainer.output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path,
                                                       trust_remote_code=cfg.model.trust_remote_code)
        data = cfg.data
        seed = data.seed if data.seed is not None else cfg.trainer.seed
        train_ds = self.dataset(data.train_files)
        pad_id = train_ds.pad_token_id

        def collate(items: list[dict[str, Any]], epoch: int) -> Batch:
            return collate_sft_rows(items, pad_id, epoch)

        self.train_loader = BatchLoader(train_ds, data.train_batch_size, seed, data.shuffle, collate=collate)
        self.val_loader = None
        if data.val_files:
            val_ds = self.dataset(data.val_files)
            self.val_loader = BatchLoader(val_ds, data.val_batch_size or len(val_ds), seed, shuffle=False,
                                           drop_last=False, collate=collate)
        self.total_steps = cfg.trainer.total_steps or len(self.train_loader) * cfg.trainer.total_epochs
        mini = cfg.optim.mini_batch_size
        optimizer_steps = self.total_steps * cfg.optim.passes_per_batch * (data.train_batch_size // mini if mini else 1)
        self.worker = WorkerGroup(SFTWorker, name="sft", n_workers=cfg.trainer.n_workers,
                                  backend=cfg.trainer.backend, device=device_type(cfg.trainer.device),
                                  init_kwargs=dict(model_cfg=cfg.model, optim_cfg=cfg.optim,
                                                   total_steps=optimizer_steps))
        self.bad_steps = BadStepCounter(cfg.trainer.max_bad_steps)
        self.step = 0
        self.checkpoints = SFTCheckpoints(self)
        self.checkpoints.maybe_resume()
        self.tracker = Tracker(cfg.trainer.loggers, self.output_dir, cfg.trainer.project_name,
                               cfg.trainer.experiment_name, cfg, self.total_steps)

    def dataset(self, files: list[str]) -> SFTDataset:
        d = self.cfg.data
        return SFTDataset(files, self.tokenizer, d.messages_key, d.prompt_key, d.response_key, d.max_length,
                          d.truncation)

    def fit(self) -> dict[str, float]:
        """Trains to `total_steps`, validating/checkpointing as configured, exports `<output_dir>/hf`;
        returns the last step's metrics."""
        try:
            metrics = run_steps(self)
            if self.step >= self.total_steps:
                export_hf(self.checkpoints.manager.latest(), self.output_dir / "hf")
        finally:
            self.close()
        return metrics

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step (or `optim.passes_per_batch` x mini-batches) on a batch of conversations."""
        timings: dict[str, float] = {}
        with timer("step", timings):
            metrics = self.worker.train_batch(batch)
        metrics.update(compute_throughput(batch, timings["step"], self.cfg.trainer.n_workers))
        metrics["timing_s/step"] = timings["step"]
        self.bad_steps.update(self.step + 1, **{k: metrics[k] for k in ("train/loss", "train/grad_norm")})
        return metrics

    def validate(self) -> dict[str, float]:
        """`val/loss`: mean NLL per assistant token over the validation conversations."""
        start = time.perf_counter()
        nll = tokens = 0.0
        for batch in self.val_loader:
            part = self.worker.eval_nll(batch)
            nll, tokens = nll + part["nll"], tokens + part["tokens"]
        return {"val/loss": nll / max(tokens, 1.0), "timing_s/val": time.perf_counter() - start}

    def close(self) -> None:
        """Stops the workers and flushes the loggers (safe to call twice)."""
        self.worker.shutdown()
        self.tracker.close()


def train_sft(cfg: Any) -> dict[str, float]:
    """Runs `hybridflow sft` for a loaded `SFTConfig`; returns the last step's metrics."""
    return SFTTrainer(cfg).fit()
