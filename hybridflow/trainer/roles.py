"""Placing the model roles of an RL run on worker groups.

`build_roles(cfg, total_steps)` returns `Roles`: handles on which the loop calls worker methods
(`roles.rollout.generate(batch)`, `roles.actor.update_actor(batch)`, `roles.sync_weights()`). With
`trainer.placement=colocate` (the default) the actor (with its rollout engine and, when a KL term needs
it, the reference), the critic and the reward model share one process per device; with `split` the
critic gets its own group of processes. With `rollout.placement=separate` the rollout engine leaves the
actor for a `RolloutWorker` group of its own, fed over a weight-sync process group (`SeparateRollout`).
Each group gets a resource pool of its own (`hybridflow.trainer.placement`: sizes, Ray nodes, checks).
Each group's workers get what their devices will hold (`memory.device_demands`), to plan the device and
refuse a run that cannot fit before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.roles import needs_critic, needs_reference
from hybridflow.controller import Remote, WorkerGroup, colocate, wait_all
from hybridflow.trainer.base import device_type, optimizer_steps
from hybridflow.trainer.memory import device_demands
from hybridflow.trainer.placement import check_placement, make_pools
from hybridflow.workers import ActorWorker, CriticWorker, RewardModelWorker, RolloutWorker
from hybridflow.workers.weight_sync import BUCKET_BYTES


class SeparateRollout:
    """`rollout.placement=separate` seen from the controller: the rollout group, the address its weight-sync
    group (the actor's rank 0 + every rollout rank) meets at (a store the actor's rank 0 hosts on its node),
    and the sync that runs both halves at once."""

    def __init__(self, actor: Remote[ActorWorker], group: WorkerGroup[RolloutWorker],
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.actor, self.group = actor, group
        self.address: tuple[str, int] = actor.open_weight_sync()
        members = (*self.address, 1 + group.world_size)
        wait_all([actor.join_weight_sync.submit(*members, bucket_bytes=bucket_bytes),
                  group.join_weight_sync.submit(*members)])

    def sync_weights(self) -> dict[str, float]:
        """The actor gathers and sends its weights while the rollout ranks receive them into their engines."""
        sent, received = wait_all([self.actor.send_weights.submit(), self.group.receive_weights.submit()])
        return {"timing_s/update_weights": max(sent["timing_s/update_weights"], received["timing_s/update_weights"])}


@dataclass
class Roles:
    """Controller-side handles on the role workers; `critic` / `reward_model` / `separate` are None when
    not used."""

    actor: Remote[ActorWorker]
    critic: Remote[CriticWorker] | None
    reward_model: Remote[RewardModelWorker] | None
    groups: list[WorkerGroup]
    separate: SeparateRollout | None = None

    @property
    def rollout(self) -> Remote[ActorWorker] | Remote[RolloutWorker]:
        """What generates: the actor (its colocated engine) or the separate rollout group."""
        return self.actor if self.separate is None else self.separate.group

    def sync_weights(self) -> dict[str, float]:
        """The actor's trained weights into the rollout engines: in place when colocated, over the
        weight-sync group when separate; returns `timing_s/update_weights`."""
        return (self.actor if self.separate is None else self.separate).sync_weights()


def skips_old_log_probs(cfg: Any) -> bool:
    """On-policy (one optimizer step per batch, no KL in reward): the update's own log-probs, detached,
    are the old ones, so their separate forward pass is skipped (`actor.skip_old_log_probs`)."""
    a = cfg.actor
    one_step = a.ppo_epochs == 1 and (a.mini_batch_size is None or a.mini_batch_size >= cfg.data.train_batch_size)
    return a.skip_old_log_probs and one_step and not cfg.algorithm.use_kl_in_reward


def role_optimizer_steps(cfg: Any, role: str, total_steps: int) -> int:
    """The optimizer steps `role` (`actor` or `critic`) takes in a run of `total_steps` trainer steps: its
    lr schedule's length. The actor does not update during the critic's `critic.warmup_steps`."""
    section = getattr(cfg, role)
    updating = total_steps - (cfg.critic.warmup_steps if role == "actor" and needs_critic(cfg) else 0)
    return optimizer_steps(updating, section.ppo_epochs, section.mini_batch_size, cfg.data.train_batch_size)


def build_roles(cfg: Any, total_steps: int) -> Roles:
    """Starts the worker groups of a run of `total_steps` trainer steps (see the module docstring) and
    returns their handles."""
    device = device_type(cfg.trainer.device, cfg.trainer.backend, cfg.ray.address)
    placed = {name: dict(pool=pool, n_workers=pool.n_processes, backend=cfg.trainer.backend, device=device,
                         worker_timeout_s=cfg.trainer.worker_timeout_s)
              for name, pool in make_pools(cfg, device).items()}
    separate = cfg.rollout.placement == "separate"
    memory = device_demands(cfg, needs_reference(cfg), needs_critic(cfg))
    kwargs = {"actor": dict(model_cfg=cfg.model, actor_cfg=cfg.actor, rollout_cfg=cfg.rollout, data_cfg=cfg.data,
                            total_steps=role_optimizer_steps(cfg, "actor", total_steps),
                            with_ref=needs_reference(cfg), with_rollout=not separate, memory=memory["actor"],
                            agent_cfg=cfg.agent, seed=cfg.trainer.seed)}
    classes: dict[str, type] = {"actor": ActorWorker}
    if cfg.reward.reward_model.path:
        classes["reward_model"], kwargs["reward_model"] = RewardModelWorker, dict(rm_cfg=cfg.reward.reward_model)
    split_critic = needs_critic(cfg) and cfg.trainer.placement == "split"
    critic_kwargs = dict(critic_cfg=cfg.critic, actor_model_cfg=cfg.model,
                         total_steps=role_optimizer_steps(cfg, "critic", total_steps), rollout_n=cfg.rollout.n,
                         memory=memory["critic" if split_critic else "actor"], seed=cfg.trainer.seed)
    if needs_critic(cfg) and not split_critic:
        classes["critic"], kwargs["critic"] = CriticWorker, critic_kwargs
    handles: dict[str, Any]  # a group, or a colocated group's member views, per role
    if len(classes) == 1:
        group = WorkerGroup(ActorWorker, name="actor", init_kwargs=kwargs["actor"], **placed["actor"])
        handles = {"actor": group}
    else:
        group = WorkerGroup(colocate(**classes), name="_".join(classes), init_kwargs=kwargs, **placed["actor"])
        handles = {name: getattr(group, name) for name in classes}
    groups = [group]
    try:
        if split_critic:
            handles["critic"] = WorkerGroup(CriticWorker, name="critic", init_kwargs=critic_kwargs, **placed["critic"])
            groups.append(handles["critic"])
        if separate:
            rollout = WorkerGroup(RolloutWorker, name="rollout", **placed["rollout"],
                                  init_kwargs=dict(model_cfg=cfg.model, rollout_cfg=cfg.rollout, data_cfg=cfg.data,
                                                   memory=memory["rollout"], agent_cfg=cfg.agent))
            groups.append(rollout)
            handles["separate"] = SeparateRollout(handles["actor"], rollout)
        if cfg.trainer.backend == "ray":
            check_placement(groups, cfg.trainer.output_dir)
    except BaseException:
        for started in groups:
            started.shutdown()
        raise
    return Roles(actor=handles["actor"], critic=handles.get("critic"), reward_model=handles.get("reward_model"),
                 groups=groups, separate=handles.get("separate"))
