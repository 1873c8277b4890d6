"""Placing the model roles of an RL run on worker groups.

`build_roles(cfg, total_steps)` returns `Roles(actor, critic)`: handles on which the loop calls
worker methods (`roles.actor.generate(batch)`). With `trainer.placement=colocate` (the default) the
actor (with its rollout engine and, when a KL term needs it, the reference), the critic and the
reward model share one process per device; with `split` the critic gets its own group of processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.controller import WorkerGroup, colocate
from hybridflow.workers import ActorWorker, CriticWorker, RewardModelWorker


@dataclass
class Roles:
    """Controller-side handles on the role workers; `critic` / `reward_model` are None when not used."""

    actor: Any
    critic: Any
    reward_model: Any
    groups: list[WorkerGroup]

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()


def resolve_device(device: str) -> str:
    """`auto` → `cuda` when a GPU is visible, else `cpu`."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def needs_reference(cfg: Any) -> bool:
    """A reference model is held only when a KL term uses it (KL loss or KL in reward)."""
    return cfg.actor.kl_loss_coef > 0 or cfg.algorithm.use_kl_in_reward


def needs_critic(cfg: Any) -> bool:
    return cfg.algorithm.adv_estimator == "gae"


def skips_old_log_probs(cfg: Any) -> bool:
    """On-policy (one optimizer step per batch, no KL in reward): the update's own log-probs, detached,
    are the old ones, so their separate forward pass is skipped (`actor.skip_old_log_probs`)."""
    a = cfg.actor
    one_step = a.ppo_epochs == 1 and (a.mini_batch_size is None or a.mini_batch_size >= cfg.data.train_batch_size)
    return a.skip_old_log_probs and one_step and not cfg.algorithm.use_kl_in_reward


def build_roles(cfg: Any, total_steps: int) -> Roles:
    """Starts the worker groups of `cfg` (see the module docstring) and returns their handles."""
    device = resolve_device(cfg.trainer.device)
    common = dict(n_workers=cfg.trainer.n_workers, backend=cfg.trainer.backend, device=device)
    kwargs = {"actor": dict(model_cfg=cfg.model, actor_cfg=cfg.actor, rollout_cfg=cfg.rollout, data_cfg=cfg.data,
                            total_steps=total_steps, with_ref=needs_reference(cfg))}
    classes: dict[str, type] = {"actor": ActorWorker}
    if cfg.reward.reward_model.path:
        classes["reward_model"], kwargs["reward_model"] = RewardModelWorker, dict(rm_cfg=cfg.reward.reward_model)
    critic_kwargs = dict(critic_cfg=cfg.critic, actor_model_cfg=cfg.model, total_steps=total_steps,
                         rollout_n=cfg.rollout.n)
    split_critic = needs_critic(cfg) and cfg.trainer.placement == "split"
    if needs_critic(cfg) and not split_critic:
        classes["critic"], kwargs["critic"] = CriticWorker, critic_kwargs
    if len(classes) == 1:
        group = WorkerGroup(ActorWorker, name="actor", init_kwargs=kwargs["actor"], **common)
        handles = {"actor": group}
    else:
        group = WorkerGroup(colocate(**classes), name="_".join(classes), init_kwargs=kwargs, **common)
        handles = {name: getattr(group, name) for name in classes}
    groups = [group]
    if split_critic:
        try:
            handles["critic"] = WorkerGroup(CriticWorker, name="critic", init_kwargs=critic_kwargs, **common)
        except BaseException:
            group.shutdown()
            raise
        groups.append(handles["critic"])
    return Roles(actor=handles["actor"], critic=handles.get("critic"), reward_model=handles.get("reward_model"),
                 groups=groups)
