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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from hybridflow.algorithms import aggregate
from hybridflow.batch import Batch
from hybridflow.checkpoint import BadStepCounter, check_writable, export_hf
from hybridflow.config.schema import ModelConfig, OptimizedRoleConfig, TrainerConfig, opt
from hybridflow.config.validate import ConfigError
from hybridflow.controller import Dispatch, WorkerGroup, register
from hybridflow.data.loader import PromptLoader
from hybridflow.data.sft import SFT_TRUNCATION_MODES, SFTDataset
from hybridflow.engine.train import LossContext, TrainEngine
from hybridflow.tracking import Tracker
from hybridflow.tracking.metrics import compute_throughput, timer
from hybridflow.trainer.checkpointing import RunCheckpoints
from hybridflow.trainer.loop import run_steps
from hybridflow.trainer.roles import device_type
from hybridflow.workers.base import EngineWorker
from hybridflow.workers.update import run_update


# ---------------------------------------------------------------------- config
@dataclass
class SFTDataConfig:
    """Chat conversations to learn from."""

    train_files: list[str] = opt([], "training conversation files: one path or a list (parquet or jsonl)")
    val_files: list[str] = opt([], "validation conversation files (val/loss); [] = no validation")
    messages_key: str = opt("messages", "column holding a conversation (a list of {role, content})")
    prompt_key: str = opt("prompt", "without messages_key: column of the user turn")
    response_key: str = opt("response", "without messages_key: column of the assistant turn")
    max_length: Optional[int] = opt(1024, "longest conversation in tokens; null = no limit")
    truncation: str = opt("error", "conversations over max_length: refuse, drop, or keep the first tokens",
                          SFT_TRUNCATION_MODES)
    train_batch_size: int = opt(32, "conversations per training step")
    val_batch_size: Optional[int] = opt(None, "conversations per validation forward batch; null = all")
    shuffle: bool = opt(True, "shuffle conversations each epoch (seeded)")
    seed: Optional[int] = opt(None, "shuffling seed; null = trainer.seed")


@dataclass
class SFTOptimConfig(OptimizedRoleConfig):
    """Optimisation of the model (AdamW, lr schedule, micro-batching and packing)."""

    lr: float = opt(1e-5, "peak learning rate")
    ppo_epochs: int = opt(1, "passes over each step's batch (each pass one optimizer step per mini-batch)")
    mini_batch_size: Optional[int] = opt(None, "conversations per optimizer step; null = the whole batch")
    micro_batch_size: Optional[int] = opt(None, "conversations per forward per rank; null = all of the rank's")
    max_tokens_per_micro_batch: Optional[int] = opt(None, "token budget per forward (rows packed up to it; "
                                                          "overrides micro_batch_size)")


@dataclass
class SFTTrainerConfig(TrainerConfig):
    """The run: length, seed, outputs, backend, validation, checkpoints and logging."""

    output_dir: str = opt("outputs/sft", "where metrics, checkpoints and the final model (hf/) go")
    val_before_train: bool = opt(False, "compute val/loss once before the first step")


@dataclass
class SFTConfig:
    """Everything `hybridflow sft` reads."""

    model: ModelConfig = opt(ModelConfig, "the model to fine-tune")
    data: SFTDataConfig = opt(SFTDataConfig, "conversation data")
    optim: SFTOptimConfig = opt(SFTOptimConfig, "optimisation")
    trainer: SFTTrainerConfig = opt(SFTTrainerConfig, "the run")


def validate_sft(cfg: Any) -> None:
    """Raises one `ConfigError` naming every problem of an `SFTConfig`, before any model loads."""
    data, optim, run = cfg.data, cfg.optim, cfg.trainer
    problems = []
    if cfg.model.path is None:
        problems.append("model.path is required (a Hugging Face model directory)")
    elif cfg.model.path.startswith(("/", ".", "~")) and not Path(cfg.model.path).expanduser().exists():
        problems.append(f"model.path={cfg.model.path}: no such directory")
    if not data.train_files:
        problems.append("data.train_files is required (one parquet/jsonl path or a list)")
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        problems += [f"{key}: file {p} not found" for p in files if not Path(p).expanduser().is_file()]
    for key, value in (("data.train_batch_size", data.train_batch_size), ("trainer.n_workers", run.n_workers),
                       ("optim.ppo_epochs", optim.ppo_epochs), ("trainer.total_epochs", run.total_epochs)):
        if value < 1:
            problems.append(f"{key}={value} must be >= 1")
    if not optim.lr > 0:
        problems.append(f"optim.lr={optim.lr} must be > 0")
    if data.train_batch_size < run.n_workers:
        problems.append(f"data.train_batch_size={data.train_batch_size} gives some of trainer.n_workers="
                        f"{run.n_workers} ranks no conversation; use >= {run.n_workers}")
    mini = optim.mini_batch_size
    if mini is not None and (mini < 1 or data.train_batch_size % mini):
        valid = [d for d in range(1, data.train_batch_size + 1) if data.train_batch_size % d == 0]
        problems.append(f"optim.mini_batch_size={mini} must divide data.train_batch_size="
                        f"{data.train_batch_size}; valid: {', '.join(map(str, valid))} or null")
    budget = optim.max_tokens_per_micro_batch
    if budget is not None and data.max_length is not None and budget < data.max_length:
        problems.append(f"optim.max_tokens_per_micro_batch={budget} is below data.max_length={data.max_length}; "
                        f"use >= {data.max_length}")
    if run.total_steps is not None and run.total_steps < 1:
        problems.append(f"trainer.total_steps={run.total_steps} must be >= 1 (or null = trainer.total_epochs)")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


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
        metrics = run_update(self.engine, batch.tensors, self.cfg, sft_loss(self.cfg), prefix="train",
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

        self.train_loader = PromptLoader(train_ds, data.train_batch_size, seed, data.shuffle, collate=collate)
        self.val_loader = None
        if data.val_files:
            val_ds = self.dataset(data.val_files)
            self.val_loader = PromptLoader(val_ds, data.val_batch_size or len(val_ds), seed, shuffle=False,
                                           drop_last=False, collate=collate)
        self.total_steps = cfg.trainer.total_steps or len(self.train_loader) * cfg.trainer.total_epochs
        mini = cfg.optim.mini_batch_size
        optimizer_steps = self.total_steps * cfg.optim.ppo_epochs * (data.train_batch_size // mini if mini else 1)
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
        """One optimizer step (or `optim.ppo_epochs` x mini-batches) on a batch of conversations."""
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
