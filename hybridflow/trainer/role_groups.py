"""Placing the model roles of an RL run on worker groups.

`build_roles(cfg, total_steps)` returns `Roles`: handles on which the loop calls worker methods
(`roles.rollout.generate(batch)`, `roles.actor.update_actor(batch)`, `roles.sync_weights()`). With
`trainer.placement=colocate` (the default) the actor (with its rollout engine and, when a KL term needs
it, the reference), the critic, the reward model and the distillation teacher share one process per device;
with `split` the critic gets its own group of processes. With `rollout.placement=separate` the rollout engine
leaves the actor for a `RolloutWorker` group of its own, fed over a weight-sync process group (`SeparateRollout`).
Each group gets a resource pool of its own (`hybridflow.trainer.placement`: sizes, Ray nodes, checks).
Each group's workers get what their devices will hold (`memory.device_demands`), to plan the device and
refuse a run that cannot fit before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.resolved import RunFacts
from hybridflow.config.role_needs import needs_critic
from hybridflow.controller import Remote, WorkerGroup, colocate, submit, wait_all
from hybridflow.trainer.base import device_type, optimizer_steps
from hybridflow.trainer.memory import device_demands
from hybridflow.trainer.placement import check_placement, make_pools
from hybridflow.trainer.role_configs import actor_config, critic_config, rollout_worker_config, teacher_config
from hybridflow.workers import ActorWorker, CriticWorker, RewardModelWorker, RolloutWorker, TeacherWorker
from hybridflow.workers.handles import RolloutHandle
from hybridflow.workers.weight_sync import BUCKET_BYTES


class SeparateRollout:
    """`rollout.placement=separate` seen from the controller: the rollout group, the address its weight-sync
    group (the actor's rank 0 + every rollout rank) meets at (a store the actor's rank 0 hosts on its node),
    and the sync that runs both halves at once."""

    def __init__(self, actor: Remote[ActorWorker], group: WorkerGroup[RolloutWorker],
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.actor, self.group = actor, group
        self.address: tuple[str, int] = actor.open_weight_sync()
        host, port = self.address
        world = 1 + group.world_size
        wait_all([submit(actor.join_weight_sync, host, port, world, bucket_bytes=bucket_bytes),
                  submit(group.join_weight_sync, host, port, world)])

    def sync_weights(self) -> dict[str, float]:
        """The actor gathers and sends its weights while the rollout ranks receive them into their engines."""
        sent, received = wait_all([submit(self.actor.send_weights), submit(self.group.receive_weights)])
        return {"timing_s/update_weights": max(sent["timing_s/update_weights"], received["timing_s/update_weights"])}


@dataclass
class Roles:
    """Controller-side handles on the role workers; `critic` / `reward_model` / `separate` / `teacher` are None
    when not used."""

    actor: Remote[ActorWorker]
    critic: Remote[CriticWorker] | None
    reward_model: Remote[RewardModelWorker] | None
    groups: list[WorkerGroup[Any]]
    separate: SeparateRollout | None = None
    teacher: Remote[TeacherWorker] | None = None

    @property
    def rollout(self) -> RolloutHandle:
        """What generates: the actor (its colocated engine) or the separate rollout group."""
        return self.actor if self.separate is None else self.separate.group

    def sync_weights(self) -> dict[str, float]:
        """The actor's trained weights into the rollout engines: in place when colocated, over the
        weight-sync group when separate; returns `timing_s/update_weights`."""
        return (self.actor if self.separate is None else self.separate).sync_weights()


def role_optimizer_steps(cfg: Any, role: str, total_steps: int) -> int:
    """The optimizer steps `role` (`actor` or `critic`) takes in a run of `total_steps` trainer steps: its
    lr schedule's length. The actor does not update during the critic's `critic.warmup_steps`."""
    section = getattr(cfg, role)
    updating = total_steps - (cfg.critic.warmup_steps if role == "actor" and needs_critic(cfg) else 0)
    return optimizer_steps(updating, section.ppo_epochs, section.mini_batch_size, cfg.data.train_batch_size)


def build_roles(cfg: Any, total_steps: int, facts: RunFacts) -> Roles:
    """Starts the worker groups of a run of `total_steps` trainer steps (see the module docstring), each worker
    built from its typed config (`hybridflow.trainer.role_configs`), and returns their handles."""
    device = device_type(cfg.trainer.device, cfg.trainer.backend, cfg.ray.address)
    placed = {name: dict(pool=pool, n_workers=pool.n_processes, backend=cfg.trainer.backend, device=device,
                         worker_timeout_s=cfg.trainer.worker_timeout_s)
              for name, pool in make_pools(cfg, device).items()}
    memory = device_demands(cfg, facts)
    kwargs: dict[str, dict[str, Any]] = {"actor": dict(config=actor_config(
        cfg, role_optimizer_steps(cfg, "actor", total_steps), memory["actor"], facts))}
    classes: dict[str, type] = {"actor": ActorWorker}
    if cfg.reward.reward_model.path:
        classes["reward_model"], kwargs["reward_model"] = RewardModelWorker, dict(rm_cfg=cfg.reward.reward_model)
    if facts.teacher:
        classes["teacher"], kwargs["teacher"] = TeacherWorker, dict(config=teacher_config(cfg, memory["actor"]))
    critic_kwargs = dict(config=critic_config(cfg, role_optimizer_steps(cfg, "critic", total_steps),
                                              memory["critic" if facts.split_critic else "actor"], facts))
    if facts.critic and not facts.split_critic:
        classes["critic"], kwargs["critic"] = CriticWorker, critic_kwargs
    handles: dict[str, Any]  # a group, or a colocated group's member views, per role
    group: WorkerGroup[Any]
    if len(classes) == 1:
        group = WorkerGroup(ActorWorker, name="actor", init_kwargs=kwargs["actor"], **placed["actor"])
        handles = {"actor": group}
    else:
        group = WorkerGroup(colocate(**classes), name="_".join(classes), init_kwargs=kwargs, **placed["actor"])
        handles = {name: getattr(group, name) for name in classes}
    groups: list[WorkerGroup[Any]] = [group]
    try:
        if facts.split_critic:
            handles["critic"] = WorkerGroup(CriticWorker, name="critic", init_kwargs=critic_kwargs, **placed["critic"])
            groups.append(handles["critic"])
        if facts.separate_rollout:
            rollout = WorkerGroup(RolloutWorker, name="rollout", **placed["rollout"],
                                  init_kwargs=dict(config=rollout_worker_config(cfg, memory["rollout"], facts)))
            groups.append(rollout)
            handles["separate"] = SeparateRollout(handles["actor"], rollout)
        if cfg.trainer.backend == "ray":
            check_placement(groups, cfg.trainer.output_dir)
    except BaseException:
        for started in groups:
            started.shutdown()
        raise
    return Roles(actor=handles["actor"], critic=handles.get("critic"), reward_model=handles.get("reward_model"),
                 groups=groups, separate=handles.get("separate"), teacher=handles.get("teacher"))
