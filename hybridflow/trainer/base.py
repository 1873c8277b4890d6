"""`Trainer`: the parts every trainer builds the same way, in one place.

`Trainer.__init__` builds, in order: the output directory (checked writable, with room for one
checkpoint, and locked to this run: `RunLock`), the checkpoints (the one to resume from found, verified and
checked against this config, before any model loads), the tokenizer, the train and validation loaders
(every row read and checked) and the trainer's checks of the data (`check_data`), the run's length, the
bad-step counter, the worker groups (then loaded from the checkpoint) and the metric tracker. What it checks
before the worker groups start, `hybridflow config` checks with the same functions, without writing anything,
reporting every problem at once (`hybridflow.trainer.preflight`); a run stops at the first. Once the workers
run, the values they filled in where the config left them open (the device plan's micro-batch budget and
checkpointing, compilation, the rollout engine) come back (`effective_values`): the run logs each device plan
once and writes the config it runs with to `resolved_config.yaml` beside `metrics.jsonl`. If any of it fails,
what was started is stopped and the lock released.
A trainer says what is its own by overriding the class methods under "what each trainer checks before models
load" (its checkpoint's size, its LoRA bases, its loaders, its checks of the data) and the methods under "what
each trainer says": its workers, what a checkpoint holds beyond the loader position and the bad-step counter,
and `train_step` / `validate`, which `fit()` drives through `hybridflow.trainer.step_loop.run_steps`.

`optimizer_steps` turns the run's length in trainer steps into the length of a role's lr schedule, which
steps once per optimizer step.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.checkpoint import BadStepCounter, RunLock, check_writable
from hybridflow.config.follow import followed_comment
from hybridflow.config.loader import to_yaml
from hybridflow.controller import WorkerGroup
from hybridflow.controller.cluster import connect
from hybridflow.data.loader import BatchLoader
from hybridflow.tracking import Tracker
from hybridflow.trainer.checkpointing import RunCheckpoints
from hybridflow.trainer.step_loop import run_steps
from hybridflow.workers.handles import TrainedRoleHandle

RESOLVED_CONFIG = "resolved_config.yaml"


def device_type(setting: str, backend: str = "local", ray_address: str | None = None) -> str:
    """The device type worker groups run on for a `trainer.device` setting: `auto` -> `cuda` when the
    workers' machines have a GPU (this machine's for the `local` backend; for `ray` the cluster's at
    `ray_address`, joined here), else `cpu`; `cpu` and `cuda` as they are."""
    if setting != "auto":
        return setting
    if backend == "ray":
        return "cuda" if connect(ray_address).cluster_resources().get("GPU", 0) else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(model_cfg: Any) -> Any:
    """The run's tokenizer: `model.tokenizer_path`, else `model.path`'s."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_cfg.tokenizer_path or model_cfg.path,
                                         trust_remote_code=model_cfg.trust_remote_code)


def optimizer_steps(trainer_steps: int, passes: int, mini_batch_size: int | None, batch_size: int) -> int:
    """Optimizer steps of `trainer_steps` steps that each make `passes` passes over a batch of `batch_size`
    prompts (or conversations), one optimizer step per mini-batch of `mini_batch_size` (None: the batch)."""
    return max(1, trainer_steps) * passes * (batch_size // mini_batch_size if mini_batch_size else 1)


class Trainer(ABC):
    """The skeleton of a trainer (see the module docstring); `fit()` trains.

    Attributes a subclass finds set: `cfg`, `output_dir`, `tokenizer`, `train_loader`, `val_loader`
    (None without validation files), `total_steps`, `bad_steps`, `step`, `groups` (every worker group of
    the run, set by `start_workers`), `checkpoints`, `tracker`.
    """

    model_role: str  # the checkpoint role whose model `hybridflow export` writes out (its HF files are saved)
    validates_at_end = False  # validate after the last step even with trainer.val_every=0
    model_head = "lm"  # that model's head (`hybridflow.engine.train.model`): a reward model's is "score"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        checkpoint_bytes = self.checkpoint_size(cfg)
        self.output_dir = check_writable(cfg.trainer.output_dir, checkpoint_bytes)
        self.lock = RunLock(self.output_dir)
        if self.lock.stale_holder:
            print(f"{self.lock.path}: taking over the lock of a run that has ended ({self.lock.stale_holder})")
        self.groups: list[WorkerGroup[Any]] = []
        self.tracker: Tracker | None = None
        try:
            self.checkpoints = RunCheckpoints(self, checkpoint_bytes)
            self.tokenizer = load_tokenizer(cfg.model)
            self.train_loader, self.val_loader = self.build_loaders(cfg, self.tokenizer)
            self.check_data(cfg, self.train_loader, self.val_loader)
            self.total_steps = cfg.trainer.total_steps or len(self.train_loader) * cfg.trainer.total_epochs
            self.bad_steps = BadStepCounter(cfg.trainer.max_bad_steps)
            self.step = 0
            self.start_workers()
            self.resolved_cfg = self.write_resolved_config()
            self.checkpoints.restore()
            rollout = getattr(cfg, "rollout", None)  # RL runs validate on val_n responses per prompt
            self.tracker = Tracker(cfg.trainer.loggers, self.output_dir, cfg.trainer.project_name,
                                   cfg.trainer.experiment_name, cfg, self.total_steps,
                                   aliases={"val_n": rollout.val_n} if rollout is not None else {})
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ what each trainer checks before models load
    # Class methods of the config (and the tokenizer): `hybridflow config` runs them without a trainer
    # (`hybridflow.trainer.preflight`).
    @classmethod
    @abstractmethod
    def checkpoint_size(cls, cfg: Any) -> int:
        """One checkpoint's size in bytes, estimated from the configs of the models it trains (`checkpoint_bytes`)."""

    @classmethod
    def lora_bases(cls, cfg: Any) -> dict[str, str]:
        """Role -> base model path of each role trained with LoRA (its checkpoint records the base's fingerprint)."""
        return {}

    @classmethod
    @abstractmethod
    def build_loaders(cls, cfg: Any, tokenizer: Any) -> tuple[BatchLoader, BatchLoader | None]:
        """The train loader and the validation loader (None without validation data); building them reads and
        checks every row."""

    @classmethod
    def check_data(cls, cfg: Any, train: BatchLoader, val: BatchLoader | None) -> None:
        """What the trainer checks of the loaded data beyond its rows (nothing by default)."""

    # ------------------------------------------------------------------ what each trainer says
    @abstractmethod
    def start_workers(self) -> None:
        """Starts the run's worker groups (listing them in `self.groups`) and what drives them."""

    @abstractmethod
    def checkpointed_roles(self) -> dict[str, TrainedRoleHandle]:
        """Role name -> handle with `save_checkpoint(dir)` / `load_checkpoint(dir)`, for each trained model."""

    def effective_handles(self) -> dict[str, Any]:
        """Role name -> handle with `effective_values()`, for every group whose workers fill in config values
        (by default the trained roles)."""
        return dict(self.checkpointed_roles())

    def checkpointed_state(self) -> dict[str, Any]:
        """The controller's state a checkpoint keeps: the loader position and the bad-step counter, plus
        what a trainer adds (objects with `state_dict()` / `load_state_dict()`)."""
        return {"data": self.train_loader, "bad_steps": self.bad_steps}

    @abstractmethod
    def train_step(self, batch: Batch) -> dict[str, float]:
        """One trainer step on a batch of the train loader; returns its metrics."""

    @abstractmethod
    def validate(self) -> dict[str, float]:
        """Metrics over the validation loader (`val/...`)."""

    # ------------------------------------------------------------------ the run
    def write_resolved_config(self) -> Any:
        """The config with what the workers filled in (`effective_handles`), written to `resolved_config.yaml`
        in the output directory under a header naming the keys that follow others (`hybridflow.config.follow`)
        and each device plan, which is also printed once (roles sharing a device share a plan); returns it."""
        resolved = copy.deepcopy(self.cfg)
        plans: dict[str, list[str]] = {}
        for name, handle in self.effective_handles().items():
            effective = handle.effective_values()
            for key, value in effective.values.items():
                *parents, leaf = key.split(".")
                node = resolved
                for part in parents:
                    node = getattr(node, part)
                setattr(node, leaf, value)
            if effective.plan is not None:
                plans.setdefault(effective.plan, []).append(name)
        header = followed_comment(resolved)
        print(header, end="", flush=True)
        for plan, names in plans.items():
            print(f"device plan of {', '.join(names)}: {plan}", flush=True)
            header += f"# device plan of {', '.join(names)}: {plan}\n"
        (self.output_dir / RESOLVED_CONFIG).write_text(header + to_yaml(resolved))
        return resolved

    def validation_batches(self) -> BatchLoader:
        """The validation loader, for `validate` (which runs only when the run has validation files)."""
        if self.val_loader is None:
            raise RuntimeError("validate() needs validation data: set data.val_files")
        return self.val_loader

    @property
    def n_devices(self) -> int:
        """Devices (processes) the run holds, over all its groups."""
        return sum(group.world_size for group in self.groups)

    def fit(self) -> dict[str, float]:
        """Trains to `total_steps` (validating and checkpointing as configured); returns the last metrics."""
        try:
            return run_steps(self)
        finally:
            self.close()

    def close(self) -> None:
        """Stops the workers, flushes the loggers and releases the output directory (safe to call twice)."""
        try:
            for group in self.groups:
                group.shutdown()
            if self.tracker is not None:
                self.tracker.close()
        finally:
            self.lock.release()
