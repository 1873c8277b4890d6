"""`EngineWorker`: what the trained roles (actor, critic, SFT) share — a forward and an update with the
role's batching, offload between uses, checkpoints.

Subclasses set `self.engine` (a `TrainEngine`) and `self.cfg` (their `OptimConfig` section: micro-batching,
packing, `param_offload` / `optimizer_offload`) in `__init__`.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.engine import LossFn
from hybridflow.engine.train.optim import apply_config
from hybridflow.workers.update import run_update


class EngineWorker(Worker):
    engine: TrainEngine
    cfg: Any
    update_count: int = 0  # updates so far: seeds each update's mini-batch shuffle

    def _infer(self, batch: Batch, **options: Any) -> dict[str, torch.Tensor]:
        """`engine.infer` over `batch` with this role's micro-batching and packing (`options`: temperature,
        with_entropy), its state on-loaded for the call."""
        self._onload()
        out = self.engine.infer(batch.tensors, micro_batch_size=self.cfg.micro_batch_size,
                                max_tokens=self.cfg.max_tokens_per_micro_batch, pack=self.cfg.use_packing, **options)
        self._offload_idle()
        return out

    def _update(self, batch: Batch, loss_fn: LossFn, **options: Any) -> dict[str, float]:
        """One trainer step's optimizer steps on `batch` (`run_update` with this role's config; `options`: passes,
        prefix, ...), its state on-loaded for the call; each update shuffles its mini-batches anew."""
        self._onload()
        metrics = run_update(self.engine, batch.tensors, self.cfg, loss_fn, seed=self.update_count, **options)
        self._offload_idle()
        self.update_count += 1
        return metrics

    def _offload_idle(self) -> None:
        """Between uses: parameter shards / optimizer state to the CPU where the config says so."""
        if self.cfg.param_offload or self.cfg.optimizer_offload:
            self.engine.offload(params=self.cfg.param_offload, optimizer=self.cfg.optimizer_offload)

    def _onload(self) -> None:
        """Before a use: bring back what `_offload_idle` moved."""
        if self.cfg.param_offload or self.cfg.optimizer_offload:
            self.engine.onload(params=self.cfg.param_offload, optimizer=self.cfg.optimizer_offload)

    @register(Dispatch.BROADCAST)
    def save_checkpoint(self, role_dir: str) -> None:
        """Model + optimizer shards, RNG of every rank, and the small state beside them (the lr schedule,
        the count of skipped non-finite steps) under `role_dir` (collective)."""
        from hybridflow.checkpoint import save_worker_state

        save_worker_state(role_dir, self.engine.model, self.engine.optimizer,
                          {"lr": self.engine.scheduler, "skipped_steps": self.engine.skipped_steps})

    @register(Dispatch.BROADCAST)
    def load_checkpoint(self, role_dir: str) -> None:
        """Inverse of `save_checkpoint`, on any number of ranks (a checkpoint without a skipped-step count
        counts from 0); this role's config then sets the lr, its schedule, betas and weight decay
        (`apply_config`), whatever the checkpoint's run used."""
        from hybridflow.checkpoint import load_worker_state

        rest = load_worker_state(role_dir, self.engine.model, self.engine.optimizer, {"lr": self.engine.scheduler})
        self.engine.skipped_steps = int(rest.get("skipped_steps", 0))
        apply_config(self.engine.optimizer, self.engine.scheduler, self.cfg)
