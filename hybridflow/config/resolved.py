"""The facts an RL run derives from its config, resolved once on the controller (`RunFacts`, `resolve_facts`).

Which roles run (a critic, a reference, a distillation teacher, ReMax's greedy baseline, multi-turn episodes),
whether the advantage estimator runs on the task's scores, whether a role trains LoRA adapters, where the
rollout and the critic run, how many rows a mini-batch holds, whether the old log-probs get a pass of their
own, whether the actor hooks a mixture of experts' routers and lends its frozen weights to the rollout engine
beside it: the trainer decides each of these here and hands the answers down typed, so no worker or engine
re-derives one from config sections. What only a worker can know (the device plan, made from its device's free
memory) comes back from it instead (`hybridflow.workers.base.Effective`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.role_needs import (agent_enabled, carries_images, distills, needs_critic, needs_greedy_baseline,
                                          needs_reference, rollout_workers, run_groups, uses_task_advantage)
from hybridflow.utils.lm_class import vision_model_type


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFacts:
    """What an `RLConfig` implies (see the module docstring).

    critic / reference / greedy_baseline / agent: the roles and episodes the run needs (a reference when a
        KL term uses one).
    teacher: on-policy distillation: a teacher (`teacher.model.path`) scores the sampled tokens.
    task_advantage: the advantage estimator runs on the task's scores (always, except distillation alone:
        `teacher.task_reward=false`, which needs no critic nor greedy baseline).
    actor_lora / critic_lora: the role trains LoRA adapters (`lora.rank` > 0); a LoRA actor's reference is
        its own base weights, so `reference_copy` (a frozen copy held beside the actor) is False then.
    separate_rollout / split_critic: `rollout.placement=separate`, `trainer.placement=split` with a critic.
    rollout_ranks: the rollout replicas, one per process that generates (`rollout.n_workers` when separate,
        else `trainer.n_workers`).
    step_rows: rows a step generates (`data.train_batch_size x rollout.n`).
    rows_in_flight: rows generated at once: `step_rows`, times `1 + rollout.partial_extra_batches` prompt
        batches with partial rollouts.
    off_policy: partial rollouts or the pipelined rollout (`rollout.partial`, `rollout.pipeline`): rows record
        each token's policy version, and what is in flight goes into checkpoints.
    actor_mini_batch_rows / critic_mini_batch_rows: rows per optimizer step over all ranks
        (`mini_batch_size x rollout.n`); None = the whole batch.
    skip_old_log_probs: on-policy (one optimizer step per batch, no KL in reward, `actor.skip_old_log_probs`):
        the update's own log-probs, detached, are the old ones, so their separate pass is skipped.
    groups: the worker groups the run starts, with their process counts (`config.role_needs.run_groups`).
    router_hooks: the actor's forwards hook a mixture of experts' routers: to compare the experts they use with
        those the rollout recorded (`rollout.record_routes`), to replay those (`actor.router_replay`), or for the
        load-balancing loss (`actor.router_aux_loss_coef` > 0).
    lend_frozen_weights: a LoRA actor on one device (`trainer.n_workers=1`, no `actor.param_offload`, which moves
        its weights) lends its frozen weights to the colocated fast rollout engine, which holds them instead of
        copies; the device plan counts the engine's copy without them. Read from the model's config: its
        architecture must have a fast path (`rollout.engine` not hf).
    vision: the run trains a vision-language model with its images (`lm_class.vision_model_type`): a
        `VISION_FAMILIES` checkpoint, Qwen3.5's as published only where the run's prompts can carry images
        (`role_needs.carries_images`: `data.image_key`, or an endpoint way in with `agent.images=true`, whose
        requests may send `image_url` parts; without either it trains as its language model alone).
    """

    critic: bool
    reference: bool
    reference_copy: bool
    greedy_baseline: bool
    agent: bool
    teacher: bool
    task_advantage: bool
    actor_lora: bool
    critic_lora: bool
    separate_rollout: bool
    split_critic: bool
    rollout_ranks: int
    step_rows: int
    rows_in_flight: int
    off_policy: bool
    actor_mini_batch_rows: int | None
    critic_mini_batch_rows: int | None
    skip_old_log_probs: bool
    groups: dict[str, int]
    router_hooks: bool
    lend_frozen_weights: bool
    vision: bool


def _rows(mini_batch_size: int | None, n: int) -> int | None:
    return None if mini_batch_size is None else mini_batch_size * n


def _fast_architecture(model: Any, images: bool) -> bool:
    """The model at `model.path`, in a run with or without `images`, has a fast rollout engine path (False without
    a path)."""
    if model.path is None:
        return False
    from transformers import AutoConfig

    from hybridflow.engine.rollout.model import FAST_ARCHITECTURES
    from hybridflow.utils.lm_class import text_view

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    return text_view(config, images).model_type in FAST_ARCHITECTURES


def resolve_facts(cfg: Any) -> RunFacts:
    """The `RunFacts` of a (validated) `RLConfig`."""
    actor, rollout, n = cfg.actor, cfg.rollout, cfg.rollout.n
    separate = rollout.placement == "separate"
    step_rows = cfg.data.train_batch_size * n
    actor_lora = actor.lora.rank > 0
    critic = needs_critic(cfg)
    reference = needs_reference(cfg)
    images = carries_images(cfg)
    one_step = actor.ppo_epochs == 1 and (actor.mini_batch_size is None
                                          or actor.mini_batch_size >= cfg.data.train_batch_size)
    return RunFacts(
        critic=critic, reference=reference, reference_copy=reference and not actor_lora,
        greedy_baseline=needs_greedy_baseline(cfg), agent=agent_enabled(cfg.agent), teacher=distills(cfg),
        task_advantage=uses_task_advantage(cfg),
        actor_lora=actor_lora, critic_lora=critic and cfg.critic.lora.rank > 0,
        separate_rollout=separate,
        split_critic=critic and cfg.trainer.placement == "split",
        rollout_ranks=rollout_workers(cfg) if separate else cfg.trainer.n_workers,
        step_rows=step_rows,
        rows_in_flight=step_rows * (1 + (rollout.partial_extra_batches if rollout.partial else 0)),
        off_policy=rollout.partial or rollout.pipeline,
        actor_mini_batch_rows=_rows(actor.mini_batch_size, n),
        critic_mini_batch_rows=_rows(cfg.critic.mini_batch_size, n),
        skip_old_log_probs=actor.skip_old_log_probs and one_step and not cfg.algorithm.use_kl_in_reward,
        groups=run_groups(cfg),
        router_hooks=(cfg.rollout.record_routes or actor.router_replay != "none" or actor.router_aux_loss_coef > 0),
        lend_frozen_weights=(actor_lora and cfg.trainer.n_workers == 1 and not actor.param_offload
                             and cfg.rollout.placement == "colocate" and cfg.rollout.engine != "hf"
                             and _fast_architecture(cfg.model, images)),
        vision=vision_model_type(cfg.model.path, images) is not None)
