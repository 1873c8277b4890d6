"""Inputs and comparisons shared by the worker tests that run an actor on two ranks."""

from __future__ import annotations

import torch

from hybridflow.batch import Batch
from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import ActorConfig, DataConfig, RLConfig, RolloutConfig, TrainerConfig
from hybridflow.controller.worker import WorkerContext
from hybridflow.engine.rollout import SamplingParams
from hybridflow.trainer.role_configs import actor_config
from hybridflow.workers import ActorWorker


def rank_prompts(rank: int) -> Batch:
    """Three left-padded prompts (5, 3 and 2 tokens) drawn per rank, with uids."""
    g = torch.Generator().manual_seed(10 + rank)
    prompts = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for i, length in enumerate((5, 3, 2)):
        prompts[i, 5 - length:] = torch.randint(4, 250, (length,), generator=g)
        mask[i, 5 - length:] = 1
    return Batch({"prompts": prompts, "attention_mask": mask}, {"uid": [f"r{rank}p{i}" for i in range(3)]})


def sampling(n: int, max_tokens: int, temperature: float = 1.0) -> SamplingParams:
    """`n` samples of at most `max_tokens` tokens per prompt at `temperature`, with a fixed seed."""
    return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=3)


def actor_worker(ctx: WorkerContext, model: ModelConfig, actor: ActorConfig, rollout: RolloutConfig,
                 data: DataConfig, total_steps: int = 1) -> ActorWorker:
    """An `ActorWorker` on `ctx` built as `hybridflow train` builds it from these sections, in a run of as many
    workers as `ctx`'s group has."""
    cfg = RLConfig(model=model, actor=actor, rollout=rollout, data=data,
                   trainer=TrainerConfig(n_workers=ctx.world_size))
    return ActorWorker.create(ctx, dict(config=actor_config(cfg, total_steps)))


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |a - b| where mask is set."""
    return float(((a - b).abs() * mask).max())
