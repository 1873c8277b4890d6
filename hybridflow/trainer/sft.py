"""`SFTTrainer`: supervised fine-tuning on chat data, behind `hybridflow sft`.

    hybridflow sft --config recipes/sft.yaml model.path=MODEL_DIR data.train_files=chats.jsonl

A step takes `data.train_batch_size` conversations (`messages`, or `prompt` + `response`, from parquet
or jsonl; `hybridflow.data.SFTDataset`), and one `SFTWorker` group trains on them with the FSDP2
`TrainEngine`: negative log-likelihood on assistant tokens only, rows packed into token-budget
micro-batches (`optim.use_packing`, `optim.max_tokens_per_micro_batch`). Checkpoints, resume and the
metric sinks are the RL trainer's; the final model is written as a Hugging Face directory under
`<trainer.output_dir>/hf`, ready for `hybridflow train model.path=<that>`.

Rows reach the engine right-padded, as "prompt" = the first token and "response" = the rest:

    input_ids       [B, W]    long     conversation tokens, right-padded with the pad id
    attention_mask  [B, W]    long     1 on real tokens
    position_ids    [B, W]    long     0.. per row
    response_mask   [B, W-1]  float32  the loss mask of tokens 1..W-1 (1.0 on assistant tokens)
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridflow.algorithms import aggregate
from hybridflow.batch import Batch
from hybridflow.checkpoint import BadStepCounter, check_writable, export_hf
from hybridflow.config.validate import validate_sft
from hybridflow.controller import Dispatch, WorkerGroup, register
from hybridflow.data.loader import BatchLoader
from hybridflow.data.sft import SFTDataset
from hybridflow.engine.train import LossContext, TrainEngine
from hybridflow.tracking import Tracker
from hybridflow.tracking.metrics import compute_throughput, timer
from hybridflow.trainer.checkpointing import RunCheckpoints
from hybridflow.trainer.loop import run_steps
from hybridflow.trainer.roles import device_type
from hybridflow.workers.base import EngineWorker
from hybridflow.workers.update import run_update


# ---------------------------------------------------------------------- data → engine rows
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


def sft_loss(cfg: Any):
    """`loss_fn` for `TrainEngine.train_step`: negative log-likelihood of the masked tokens, aggregated
    with `cfg.loss_agg` over the whole mini-batch; reports `train/loss`."""

    def loss_fn(out: dict, mb: dict, ctx: LossContext):
        mask = mb["response_mask"]
        loss = aggregate(-out["log_probs"], mask, cfg.loss_agg, ctx.global_tokens, ctx.global_seqs, mask.shape[1])
        return loss, {"train/loss": loss.detach() * ctx.share_to_value(mask)}

    return loss_fn


class SFTWorker(EngineWorker):
    """The model being fine-tuned on this rank: a `TrainEngine` and the SFT loss."""

    def __init__(self, model_cfg: Any, optim_cfg: Any, total_steps: int = 1) -> None:
        self.cfg = optim_cfg
        self.engine = TrainEngine(model_cfg, optim_cfg, head="lm", total_steps=total_steps, device=self.device)
        self.update_count = 0
        self._offload_idle()

    @register(Dispatch.DATA_PARALLEL, collect="same")
    def train_batch(self, batch: Batch) -> dict[str, float]:
        """Optimizer step(s) on this rank's rows; `train/{loss,grad_norm,lr}`, identical on all ranks."""
        self._onload()
        metrics = run_update(self.engine, batch.tensors, self.cfg, sft_loss(self.cfg),
                             passes=self.cfg.passes_per_batch, prefix="train",
                             seed=self.update_count)
        self._offload_idle()
        self.update_count += 1
        return metrics

    @register(Dispatch.DATA_PARALLEL)
    def eval_nll(self, batch: Batch) -> dict[str, float]:
        """`{"nll": summed NLL of the masked tokens, "tokens": their count}` over this rank's rows."""
        self._onload()
        out = self.engine.infer(batch.tensors, micro_batch_size=self.cfg.micro_batch_size,
                                max_tokens=self.cfg.max_tokens_per_micro_batch, pack=self.cfg.use_packing)
        self._offload_idle()
        mask = batch["response_mask"]
        return {"nll": float(-(out["log_probs"] * mask).sum()), "tokens": float(mask.sum())}


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
            for part in self.worker.eval_nll(batch):
                nll, tokens = nll + part["nll"], tokens + part["tokens"]
        return {"val/loss": nll / max(tokens, 1.0), "timing_s/val": time.perf_counter() - start}

    def close(self) -> None:
        """Stops the workers and flushes the loggers (safe to call twice)."""
        self.worker.shutdown()
        self.tracker.close()


def train_sft(cfg: Any) -> dict[str, float]:
    """Runs `hybridflow sft` for a loaded `SFTConfig`; returns the last step's metrics."""
    return SFTTrainer(cfg).fit()
