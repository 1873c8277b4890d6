"""Where the worker groups of an RL run go, decided and checked before any model loads.

`make_pools(cfg, device)` gives each group the run starts (`run_groups`: the actor with the roles
colocated with it, the critic when `trainer.placement=split`, the rollout when
`rollout.placement=separate`) a `ResourcePool` of its own, and refuses a run the devices cannot hold: on
the local backend this machine's GPUs; on Ray the alive nodes of the cluster `ray.address` names, each
pool cut into `ray.<section>.nnodes` shares placed by `ray.<section>.strategy` on nodes that have
`ray.<section>.node_resource` (`ray.actor` shapes the actor's and the split critic's pools, `ray.rollout`
the separate rollout's). Once the groups have started, `check_placement` prints which node each rank
landed on and refuses a cluster whose nodes do not all see `trainer.output_dir` (each rank writes its
checkpoint shards there).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.role_needs import GROUP_KEYS, run_groups
from hybridflow.config.validate import ConfigError
from hybridflow.controller import ResourcePool, WorkerGroup
from hybridflow.controller.cluster import CapacityError, alive_nodes, check_capacity, connect, unseen_on

LOCAL_LABELS = {"critic": "critic (trainer.placement=split)", "rollout": "rollout (rollout.placement=separate)"}


def _check_local_gpus(groups: dict[str, int], device: str) -> None:
    """Each local group gets GPUs of its own; the pools would refuse the last group only after the first
    loaded its model, so the total is checked first."""
    have = torch.cuda.device_count()
    if device != "cuda" or sum(groups.values()) <= have:
        return
    listed = ", ".join(f"{n} for {LOCAL_LABELS.get(name, name)}" for name, n in groups.items())
    raise ConfigError(f"this run needs {sum(groups.values())} GPUs ({listed}) but this machine has {have} "
                      f"(torch.cuda.device_count()); lower trainer.n_workers / rollout.n_workers, or use "
                      f"rollout.placement=colocate / trainer.placement=colocate")


def make_pools(cfg: Any, device: str) -> dict[str, ResourcePool]:
    """One pool per group of the run (keyed `actor` / `critic` / `rollout`); a `ConfigError` naming the keys
    to change when this machine or the Ray cluster cannot hold them all."""
    groups = run_groups(cfg)
    if cfg.trainer.backend == "local":
        _check_local_gpus(groups, device)
        return {name: ResourcePool(n, device, name=name) for name, n in groups.items()}
    pools, fixes = {}, {}
    for name, n in groups.items():
        section, size_key = GROUP_KEYS[name]
        shape = getattr(cfg.ray, section)
        pools[name] = ResourcePool(n, device, nodes=shape.nnodes, name=name, strategy=shape.strategy,
                                   node_resource=shape.node_resource)
        fixes[name] = (f"change {size_key}, ray.{section}.nnodes, ray.{section}.strategy or "
                       f"ray.{section}.node_resource, or add nodes")
    try:
        check_capacity(list(pools.values()), alive_nodes(connect(cfg.ray.address)), fixes)
    except CapacityError as exc:  # a config the cluster cannot hold: reported like any other config problem
        raise ConfigError(str(exc)) from None
    return pools


def check_placement(groups: list[WorkerGroup], output_dir: str) -> None:
    """Ray runs: prints where each group's ranks run, then refuses nodes that cannot see `output_dir`."""
    nodes: dict[str, str] = {}
    for group in groups:
        placement = group.placement()
        print(f"placement: group '{group.name}' (pool '{group.pool.name}'): {placement.describe()}")
        nodes.update(zip(placement.nodes, placement.ips))
    ray = connect()
    nodes.pop(ray.get_runtime_context().get_node_id(), None)  # the controller's own node sees it
    if not nodes:
        return
    marker = Path(output_dir) / f".node_check_{uuid.uuid4().hex}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    try:
        blind = unseen_on(ray, str(marker.resolve()), list(nodes))
    finally:
        marker.unlink()
    if blind:
        listed = ", ".join(f"{node[:8]} ({nodes[node]})" for node in blind)
        raise RuntimeError(f"trainer.output_dir={output_dir} is not visible from node(s) {listed}: every rank writes "
                           f"its checkpoint shards there and the controller commits them, so it must be one "
                           f"directory every node mounts at the same path (NFS, a shared disk)")
