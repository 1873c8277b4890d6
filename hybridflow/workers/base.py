"""`EngineWorker`: what the trained roles (actor, critic, SFT) share — the device plan, a forward and an
update with the role's batching, offload between uses, checkpoints, out-of-memory errors that name the
plan and the keys to change.

Subclasses call `_plan_device` first in `__init__` (it sets `self.plan` and fills in what the config left
to the plan), then set `self.engine` (a `TrainEngine`), `self.cfg` (their `EngineOptimConfig` section:
micro-batching, packing, `param_offload` / `optimizer_offload`) and `self.mini_batch_rows` (resolved on the
controller); `keys` / `model_keys` on the class name their config sections. `effective_values` reports
back what the plan and the engine filled in (`Effective`), for the run's `resolved_config.yaml`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from hybridflow.batch import Batch
from hybridflow.config.model_schema import EngineOptimConfig, ModelConfig
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine import budget
from hybridflow.engine.contracts import TrainEngineContract
from hybridflow.engine.train.loss_context import LossFn
from hybridflow.engine.train.optim import apply_config
from hybridflow.workers.update import run_update

Section = TypeVar("Section", bound=EngineOptimConfig)
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}


@dataclass
class Effective:
    """What a worker runs with where the config left it open: `values` by dotted config key (`actor.
    max_tokens_per_micro_batch`, `model.gradient_checkpointing`, ...), and its device plan's description
    (None off an accelerator)."""

    values: dict[str, Any] = field(default_factory=dict)
    plan: str | None = None


class EngineWorker(Worker):
    engine: TrainEngineContract
    cfg: EngineOptimConfig
    model_cfg: ModelConfig  # with what the device plan filled in
    mini_batch_rows: int | None = None  # rows per optimizer step over all ranks; None = the whole batch
    update_count: int = 0  # updates so far: seeds each update's mini-batch shuffle
    plan: budget.DevicePlan | None = None
    keys: str  # the role's config section ("actor")
    # `param_offload`'s shards left on the device by an update for the weight push right after it (the actor's
    # sync): moving them off and straight back on would cost two copies of the model per step
    params_on_device: bool = False
    model_keys: str  # its model's ("model")

    def _plan_device(self, memory: budget.DeviceDemand | None, model_cfg: ModelConfig,
                     role_cfg: Section) -> tuple[ModelConfig, Section]:
        """Plans this rank's device from what it will hold (`memory`; refuses a run that cannot fit, before
        any model loads) and returns the model and role sections with what they left to the plan filled in."""
        self.plan = budget.plan_for_device(memory, self.device)
        self.model_cfg, role_cfg = budget.apply_plan(self.plan, self.keys, model_cfg, role_cfg)
        return self.model_cfg, role_cfg

    @register(Dispatch.BROADCAST)
    def effective_values(self) -> Effective:
        """The values this role runs with where its config left them to the device plan or the device: its
        micro-batch token budget, gradient checkpointing, optimizer and its offload, compilation and compute dtype
        (rank 0's)."""
        values = {f"{self.keys}.max_tokens_per_micro_batch": self.cfg.max_tokens_per_micro_batch,
                  f"{self.keys}.optimizer": self.cfg.optimizer,
                  f"{self.keys}.optimizer_offload": self.cfg.optimizer_offload,
                  f"{self.model_keys}.gradient_checkpointing": self.model_cfg.gradient_checkpointing,
                  f"{self.model_keys}.compile": self.engine.compiled,
                  f"{self.model_keys}.dtype": DTYPE_NAMES.get(str(self.engine.precision.param),
                                                              self.model_cfg.dtype)}
        return Effective(values, None if self.plan is None else self.plan.describe())

    @contextlib.contextmanager
    def _reported_oom(self, what: str) -> Iterator[None]:
        """A CUDA out-of-memory error in the block comes out as `budget.DeviceOutOfMemory`."""
        with budget.reported_oom(f"{self.keys} {what}", self.plan, self.engine.describe(),
                                 budget.memory_keys(self.keys, self.model_keys)):
            yield

    def _infer(self, batch: Batch, **options: Any) -> dict[str, torch.Tensor]:
        """`engine.infer` over `batch` with this role's micro-batching and packing (`options`: temperature,
        with_entropy), its parameters on-loaded for the call (a forward needs no optimizer state)."""
        self._onload(optimizer=False)
        with self._reported_oom("forward pass"):
            out = self.engine.infer(batch.tensors, micro_batch_size=self.cfg.micro_batch_size,
                                    max_tokens=self.cfg.max_tokens_per_micro_batch, pack=self.cfg.use_packing,
                                    **options)
        self._offload_idle(optimizer=False)
        return out

    def _update(self, batch: Batch, loss_fn: LossFn, keep_params: bool = False, **options: Any) -> dict[str, float]:
        """One trainer step's optimizer steps on `batch` (`run_update` with this role's config; `options`: passes,
        prefix, ...), its state on-loaded for the call; each update shuffles its mini-batches anew. With
        `keep_params` the parameter shards stay on the device afterwards (`params_on_device`)."""
        self._onload()
        with self._reported_oom("update"):
            metrics = run_update(self.engine, batch.tensors, self.cfg, loss_fn, seed=self.update_count,
                                 mini_batch_rows=self.mini_batch_rows, **options)
        self._offload_idle(keep_params)
        self.update_count += 1
        return metrics

    def _offload_idle(self, keep_params: bool = False, optimizer: bool = True) -> None:
        """Between uses: parameter shards / optimizer state (unless `optimizer` is False: it was not on-loaded)
        to the CPU where the config says so; with `keep_params` the shards stay on the device
        (`params_on_device`)."""
        keep = self.cfg.param_offload and keep_params
        params = self.cfg.param_offload and not keep
        optimizer = bool(self.cfg.optimizer_offload) and optimizer  # filled in by `_plan_device`
        if params or optimizer:
            self.engine.offload(params=params, optimizer=optimizer)
        self.params_on_device = keep

    def _release_params(self) -> None:
        """The shards an update kept on the device (`params_on_device`) go to the CPU now."""
        if self.params_on_device:
            self.engine.offload(params=True, optimizer=False)
            self.params_on_device = False

    def _onload(self, optimizer: bool = True) -> None:
        """Before a use: bring back what `_offload_idle` moved (the optimizer state only if `optimizer`)."""
        params = self.cfg.param_offload and not self.params_on_device
        optimizer = bool(self.cfg.optimizer_offload) and optimizer
        if params or optimizer:
            self.engine.onload(params=params, optimizer=optimizer)

    @register(Dispatch.BROADCAST)
    def save_checkpoint(self, role_dir: str) -> None:
        """Model + optimizer shards, RNG of every rank, and the small state beside them (the lr schedule,
        the count of skipped non-finite steps, the count of updates that seeds the next one's mini-batch
        shuffle) under `role_dir` (collective). With LoRA the model's part is
        its adapters (the frozen weights are the model directory's), beside peft's `adapter_config.json`,
        from which `hybridflow export` writes an adapter directory or a merged model."""
        from hybridflow.checkpoint import save_worker_state

        adapters = self.engine.adapters
        save_worker_state(role_dir, self.engine.model, self.engine.optimizer,
                          {"lr": self.engine.scheduler, "skipped_steps": self.engine.skipped_steps,
                           "update_count": self.update_count},
                          trainable_only=adapters is not None)
        if adapters is not None and self.rank == 0:
            adapters.peft_config.save_pretrained(role_dir)

    @register(Dispatch.BROADCAST, collect="all")
    def non_finite_weights(self) -> str | None:
        """This rank's first parameter shard holding NaN or inf (`non_finite_parameter`), or None: asked before
        every checkpoint, which is never written with such weights (`RunCheckpoints.save`)."""
        from hybridflow.checkpoint import non_finite_parameter

        return non_finite_parameter(self.engine.model)

    @register(Dispatch.BROADCAST)
    def load_checkpoint(self, role_dir: str) -> None:
        """Inverse of `save_checkpoint`, on any number of ranks (a checkpoint without a skipped-step or update
        count counts from 0); this role's config then sets the lr, its schedule, betas and weight decay
        (`apply_config`), whatever the checkpoint's run used."""
        from hybridflow.checkpoint import load_worker_state

        rest = load_worker_state(role_dir, self.engine.model, self.engine.optimizer, {"lr": self.engine.scheduler},
                                 trainable_only=self.engine.adapters is not None)
        self.engine.skipped_steps = int(rest.get("skipped_steps", 0))
        self.update_count = int(rest.get("update_count", 0))
        apply_config(self.engine.optimizer, self.engine.scheduler, self.cfg)
