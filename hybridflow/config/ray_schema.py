"""The `ray` section of `hybridflow train` (docs/placement.md): the Ray cluster of `trainer.backend=ray` and
where each worker group's processes go on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybridflow.config.options import opt


@dataclass
class PoolConfig:
    """Where one worker group's processes go on a Ray cluster (`trainer.backend=ray`)."""

    nnodes: int = opt(1, "nodes the group is spread over: its processes are cut into nnodes equal shares, each "
                         "on one node (processes / nnodes devices per node)")
    strategy: str = opt("spread", "spread: every share on a node of its own; pack: as few nodes as hold the "
                                  "shares (several may share a node with room)", ("spread", "pack"))
    node_resource: Optional[str] = opt(None, "pin the group to nodes that have this custom Ray resource "
                                             "(ray start --resources='{\"NAME\": 1}'); null = any node")


@dataclass
class RayConfig:
    """The Ray cluster of `trainer.backend=ray`, and where each worker group goes on it."""

    address: Optional[str] = opt(None, "cluster to join: null = RAY_ADDRESS, else the one last started with "
                                       "`ray start` on this machine, else a new local one; auto = an existing "
                                       "cluster (fail if none); HOST:PORT = that head node")
    actor: PoolConfig = opt(PoolConfig, "the actor's group (with the roles colocated with it) and, with "
                                        "trainer.placement=split, the critic's own group alike: "
                                        "trainer.n_workers processes each")
    rollout: PoolConfig = opt(PoolConfig, "the separate rollout group (rollout.placement=separate): "
                                          "rollout.n_workers processes")
