"""`SingleModelTrainer`: a `Trainer` of one model in one worker group, what `hybridflow sft`, `dpo` and `rm` share
(`hybridflow.trainer.sft_trainer`, `hybridflow.trainer.preference_trainer`): the group started from a worker class
and its config, the checkpointed role, its size and its LoRA base, the length of its lr schedule, and the export of a
finished run's model to `<trainer.output_dir>/hf` (a whole model: with LoRA the adapters merged into the base).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from hybridflow.checkpoint import export_hf
from hybridflow.controller import Remote, WorkerGroup, remote
from hybridflow.trainer.base import Trainer, device_type, optimizer_steps
from hybridflow.trainer.checkpointing import checkpoint_bytes
from hybridflow.workers.base import EngineWorker
from hybridflow.workers.handles import TrainedRoleHandle

W = TypeVar("W", bound=EngineWorker)  # a worker that trains a model and checkpoints it


class SingleModelTrainer(Trainer, Generic[W]):
    """A subclass's `start_workers` calls `start_group(WorkerClass, config)`; `self.workers` is then the group's
    handle. Its config has `optim` (with `lora`, `passes_per_batch`, `mini_batch_size`) and `data.train_batch_size`."""

    validates_at_end = True  # the final validation says what the exported model is worth
    workers: Remote[W]

    @classmethod
    def checkpoint_size(cls, cfg: Any) -> int:
        return checkpoint_bytes([(cfg.model.path, cls.model_head, cfg.optim.lora)], cfg.model.trust_remote_code)

    @classmethod
    def lora_bases(cls, cfg: Any) -> dict[str, str]:
        return {cls.model_role: cfg.model.path} if cfg.optim.lora.rank > 0 else {}

    def schedule_steps(self) -> int:
        """The optimizer steps of the run (its lr schedule's length)."""
        cfg = self.cfg
        return optimizer_steps(self.total_steps, cfg.optim.passes_per_batch, cfg.optim.mini_batch_size,
                               cfg.data.train_batch_size)

    def start_group(self, worker: type[W], config: Any) -> None:
        """Starts the one group of `trainer.n_workers` `worker` processes, named after the model's role, each given
        `config`."""
        trainer = self.cfg.trainer
        group = WorkerGroup(worker, name=self.model_role, n_workers=trainer.n_workers, backend=trainer.backend,
                            device=device_type(trainer.device, trainer.backend),
                            worker_timeout_s=trainer.worker_timeout_s, init_kwargs=dict(config=config))
        self.groups = [group]
        self.workers = remote(group)

    def checkpointed_roles(self) -> dict[str, TrainedRoleHandle]:
        return {self.model_role: self.workers}

    def fit(self) -> dict[str, float]:
        """Trains to `total_steps`, validating/checkpointing as configured, exports `<output_dir>/hf`; returns the
        last step's metrics."""
        metrics = super().fit()
        latest = self.checkpoints.manager.latest()
        if self.step >= self.total_steps and latest is not None:  # a finished run saved its last step
            export_hf(latest, self.output_dir / "hf", role=self.model_role, merge=True)
        return metrics
