"""Each worker role's typed config, made on the controller from an `RLConfig` and its `RunFacts`, or from a
preference program's config (`hybridflow dpo`, `hybridflow rm`).

A worker gets its own `Config` (`ActorWorker.Config`, `CriticWorker.Config`, `RolloutWorker.Config`,
`TeacherWorker.Config`, and the `RolloutReplica.Config` inside the actor's or the rollout worker's;
`PreferenceWorker.Config`), never the whole tree: the sections it reads, and the facts the controller resolved
for it (`hybridflow.config.resolved`), such as its rows per mini-batch or whether it holds a reference copy.
`train_sampling` is the `SamplingParams` a training step generates with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridflow.config.resolved import RunFacts, resolve_facts
from hybridflow.engine import budget
from hybridflow.engine.rollout import SamplingParams
from hybridflow.engine.train.router_replay import RouterHooks
from hybridflow.workers import ActorWorker, CriticWorker, RolloutWorker, TeacherWorker
from hybridflow.workers.preference_worker import PAIR, PreferenceWorker
from hybridflow.workers.rollout_replica import RolloutReplica


def replica_config(cfg: Any, facts: RunFacts) -> RolloutReplica.Config:
    """The rollout engine's config: the `rollout` section, the model directory, the `data` lengths, the rows
    generated at once, when episodes are on the `agent` section, and whether its prompts carry images."""
    return RolloutReplica.Config(model_path=cfg.model.path, tokenizer_path=cfg.model.tokenizer_path,
                                 rollout=cfg.rollout, max_prompt_length=cfg.data.max_prompt_length,
                                 max_response_length=cfg.data.max_response_length, rows_in_flight=facts.rows_in_flight,
                                 agent=cfg.agent if facts.agent else None, images=facts.vision)


def actor_config(cfg: Any, total_steps: int, memory: budget.DeviceDemand | None = None,
                 facts: RunFacts | None = None) -> ActorWorker.Config:
    """The actor's config for a run whose actor takes `total_steps` optimizer steps (`memory`: its device's
    demand; `facts`: the config's, resolved here when not given); with `rollout.exact` its forward runs the
    rollout's invariant kernels for rows as long as the run generates, and with `facts.router_hooks` its
    forwards hook a mixture of experts' routers as the `actor` section says."""
    facts = facts or resolve_facts(cfg)
    exact_len = cfg.data.max_prompt_length + cfg.data.max_response_length if cfg.rollout.exact else None
    router = RouterHooks.Config(replay=cfg.actor.router_replay == "rollout",
                                aux_loss_coef=cfg.actor.router_aux_loss_coef) if facts.router_hooks else None
    return ActorWorker.Config(model=cfg.model, actor=cfg.actor,
                              rollout=None if facts.separate_rollout else replica_config(cfg, facts),
                              reference_copy=facts.reference_copy, mini_batch_rows=facts.actor_mini_batch_rows,
                              total_steps=total_steps, memory=memory, seed=cfg.trainer.seed, exact_len=exact_len,
                              router=router, lend_frozen_weights=facts.lend_frozen_weights,
                              topk_coef=cfg.teacher.topk_coef if facts.teacher and cfg.teacher.topk else 0.0,
                              topk_beta=cfg.teacher.topk_beta, images=facts.vision)


def critic_config(cfg: Any, total_steps: int, memory: budget.DeviceDemand | None = None,
                  facts: RunFacts | None = None) -> CriticWorker.Config:
    """The critic's config; a null `critic.model.path` becomes the actor's `model.path`."""
    facts = facts or resolve_facts(cfg)
    model = cfg.critic.model
    if model.path is None:
        model = dataclasses.replace(model, path=cfg.model.path)
    return CriticWorker.Config(model=model, critic=cfg.critic, mini_batch_rows=facts.critic_mini_batch_rows,
                               total_steps=total_steps, memory=memory, seed=cfg.trainer.seed)


def rollout_worker_config(cfg: Any, memory: budget.DeviceDemand | None = None,
                          facts: RunFacts | None = None) -> RolloutWorker.Config:
    """The separate rollout group's config."""
    return RolloutWorker.Config(model=cfg.model, replica=replica_config(cfg, facts or resolve_facts(cfg)),
                                memory=memory)


def teacher_config(cfg: Any, memory: budget.DeviceDemand | None = None) -> TeacherWorker.Config:
    """The distillation teacher's config: `teacher.model` and its offload, and the actor's sections whose
    micro-batching its forwards use (`memory`: the actor's device's demand, which counts the teacher)."""
    return TeacherWorker.Config(model=cfg.teacher.model, actor_model=cfg.model, actor=cfg.actor,
                                param_offload=cfg.teacher.param_offload, memory=memory, topk=cfg.teacher.topk)


def train_sampling(cfg: Any) -> SamplingParams:
    """How a training step samples: `rollout.n`, temperature, top-p and top-k, `data.max_response_length`
    new tokens, seeded with `trainer.seed` (each call mixes in its step and rank)."""
    r = cfg.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_tokens=cfg.data.max_response_length, seed=cfg.trainer.seed)


def preference_config(cfg: Any, head: str, pad_id: int, total_steps: int,
                      memory: budget.DeviceDemand | None = None) -> PreferenceWorker.Config:
    """The preference worker's config for a `DPOConfig` (head `lm`, its `dpo` loss) or a `RewardModelTrainConfig`
    (head `score`, its `rm` loss); a mini-batch of `optim.mini_batch_size` pairs is twice as many engine rows."""
    pairs = cfg.optim.mini_batch_size
    return PreferenceWorker.Config(model=cfg.model, optim=cfg.optim, loss=cfg.dpo if head == "lm" else cfg.rm,
                                   head=head, pad_id=pad_id, mini_batch_rows=None if pairs is None else pairs * PAIR,
                                   total_steps=total_steps, memory=memory, seed=cfg.trainer.seed)
