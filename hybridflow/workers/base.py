"""`EngineWorker`: what the trained roles (actor, critic) share — offload between uses, checkpoints.

Subclasses set `self.engine` (a `TrainEngine`) and `self.cfg` (their config section, with
`param_offload` / `optimizer_offload`) in `__init__`.
"""

from __future__ import annotations

from typing import Any

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine.train import TrainEngine


class EngineWorker(Worker):
    engine: TrainEngine
    cfg: Any

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
        counts from 0)."""
        from hybridflow.checkpoint import load_worker_state

        rest = load_worker_state(role_dir, self.engine.model, self.engine.optimizer, {"lr": self.engine.scheduler})
        self.engine.skipped_steps = int(rest.get("skipped_steps", 0))
