"""A trained role's checkpoint restores its engine's state: weights, lr schedule, skipped-step count and the
update count that seeds the next update's mini-batch shuffle."""

from __future__ import annotations

import torch

from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import CriticConfig
from hybridflow.controller.worker import WorkerContext
from hybridflow.workers import CriticWorker


def test_worker_checkpoint_restores_the_engine_state(tiny_qwen2, tmp_path):
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"), "critic", None)
    cfg = CriticConfig(model=ModelConfig(path=str(tiny_qwen2), dtype="fp32"), lr_schedule="cosine")
    critic = CriticWorker.create(ctx, dict(config=CriticWorker.Config(model=cfg.model, critic=cfg, total_steps=10)))
    critic.engine.skipped_steps = 3
    critic.update_count = 5
    critic.engine.clip_and_step()  # one (gradient-free) optimizer step moves the schedule
    critic.save_checkpoint(str(tmp_path / "critic"))
    resumed = CriticWorker.create(ctx, dict(config=CriticWorker.Config(model=cfg.model, critic=cfg, total_steps=10)))
    resumed.load_checkpoint(str(tmp_path / "critic"))
    assert resumed.engine.skipped_steps == 3 and resumed.update_count == 5
    assert resumed.engine.scheduler.last_epoch == critic.engine.scheduler.last_epoch == 1
