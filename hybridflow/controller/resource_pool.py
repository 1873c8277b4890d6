"""`ResourcePool`: a named set of devices (GPUs) or CPU slots that worker groups are placed on.

A group takes ranks ``0 … n_workers-1`` of its pool. CPU slots may be shared by several groups
(their processes time-share the cores); a GPU pool holds one group at a time, so roles that must
share GPUs are colocated into one worker class (`colocate`). Local CUDA pools claim distinct GPU
ids of this machine; Ray pools become one placement group each (`hybridflow.controller.cluster`).
`Placement` says where a started group's ranks landed.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch

_names = itertools.count()
_claims_lock = threading.Lock()
_claimed_gpus: dict[int, str] = {}  # local GPU id -> name of the pool holding it
STRATEGIES = ("spread", "pack")


class ResourcePool:
    """`n_processes` slots of `device` ("cpu" or "cuda") over `nodes` machines.

    Args:
        n_processes: total processes (one per GPU for cuda pools); must divide by `nodes`.
        device: ``"cpu"`` or ``"cuda"``.
        nodes: shares the pool is cut into, each of ``n_processes / nodes`` slots on one machine
            (the local backend runs on one); rank ``r`` is in share ``r // per_node``.
        name: shown in error messages; defaults to ``pool<N>``.
        cpus_per_process: CPUs each slot reserves in a Ray placement group.
        strategy: Ray only: ``"spread"`` puts every share on a machine of its own; ``"pack"`` puts
            the shares on as few machines as hold them (several may land on one).
        node_resource: Ray only: a custom resource every machine of the pool must have
            (``ray start --resources='{"NAME": 1}'``), which pins the pool to those machines.
    """

    def __init__(
        self,
        n_processes: int,
        device: str = "cpu",
        nodes: int = 1,
        name: str | None = None,
        cpus_per_process: float = 1.0,
        strategy: str = "spread",
        node_resource: str | None = None,
    ) -> None:
        self.name = name or f"pool{next(_names)}"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"ResourcePool '{self.name}': device must be 'cpu' or 'cuda', got {device!r}")
        if not isinstance(n_processes, int) or n_processes < 1:
            raise ValueError(f"ResourcePool '{self.name}': n_processes must be a positive int, got {n_processes!r}")
        if not isinstance(nodes, int) or nodes < 1 or n_processes % nodes:
            raise ValueError(
                f"ResourcePool '{self.name}': {n_processes} processes cannot be spread evenly over "
                f"nodes={nodes!r}; use a node count that divides {n_processes}"
            )
        if strategy not in STRATEGIES:
            raise ValueError(f"ResourcePool '{self.name}': strategy must be one of {STRATEGIES}, got {strategy!r}")
        if node_resource is not None and (not isinstance(node_resource, str) or not node_resource):
            raise ValueError(f"ResourcePool '{self.name}': node_resource must be a resource name or None, "
                             f"got {node_resource!r}")
        self.n_processes, self.device, self.nodes = n_processes, device, nodes
        self.cpus_per_process, self.strategy, self.node_resource = cpus_per_process, strategy, node_resource
        self.groups: list[str] = []
        self.backend: str | None = None
        self.gpu_ids: list[int] = []
        self.placement: Any = None  # the Ray placement group, made by the Ray backend

    @property
    def per_node(self) -> int:
        return self.n_processes // self.nodes

    def __repr__(self) -> str:
        return f"ResourcePool('{self.name}', {self.n_processes} {self.device}, nodes={self.nodes})"

    def attach(self, group: str, n_workers: int, backend: str) -> None:
        """Reserves ranks ``0 … n_workers-1`` for `group`, or refuses with what would be valid."""
        what = f"ResourcePool '{self.name}' ({self.n_processes} {self.device} slots over {self.nodes} node(s))"
        if n_workers > self.n_processes:
            raise ValueError(
                f"group '{group}' asks for {n_workers} processes but {what} has only {self.n_processes}; "
                f"use n_workers <= {self.n_processes} or a larger pool"
            )
        if self.backend is not None and self.groups and self.backend != backend:
            raise ValueError(
                f"group '{group}' uses backend '{backend}' but {what} is in use by backend "
                f"'{self.backend}' (groups {self.groups}); give it its own pool"
            )
        if self.device == "cuda" and self.groups:
            raise ValueError(
                f"group '{group}' cannot join {what}: its GPUs are held by group(s) {self.groups} and "
                f"GPUs are not shared between groups. Colocate the roles in one group "
                f"(colocate(actor=..., critic=...)) or give '{group}' its own ResourcePool"
            )
        if backend == "local":
            if self.nodes != 1:
                raise ValueError(f"{what}: the local backend runs on one machine; use nodes=1 or backend='ray'")
            if self.node_resource is not None:
                raise ValueError(f"{what}: node_resource={self.node_resource!r} picks Ray nodes; the local backend "
                                 f"runs on this machine, use node_resource=None or backend='ray'")
            if self.device == "cuda" and not self.gpu_ids:
                self.gpu_ids = _claim_gpus(self.name, self.n_processes)
        self.backend = backend
        self.groups.append(group)

    def detach(self, group: str) -> None:
        """Releases `group`'s slots; a pool left empty also gives back its local GPUs."""
        if group in self.groups:
            self.groups.remove(group)
        if not self.groups:
            _release_gpus(self.name)
            self.gpu_ids = []


@dataclass(frozen=True)
class Placement:
    """Where a started group's ranks run: each rank's node (a Ray node id, or ``"local"``) and its IP, and
    the address its process group met at (on Ray, a store hosted by rank 0 on rank 0's node)."""

    nodes: list[str]
    ips: list[str]
    master: tuple[str, int] | None = None

    def describe(self) -> str:
        """``ranks 0-1 on node 3f2a1c0d (10.0.0.1), ranks 2-3 on node 9b8e7d6c (10.0.0.2)``."""
        parts, start = [], 0
        for rank in range(1, len(self.nodes) + 1):
            if rank == len(self.nodes) or self.nodes[rank] != self.nodes[start]:
                ranks = f"rank {start}" if rank - start == 1 else f"ranks {start}-{rank - 1}"
                parts.append(f"{ranks} on node {self.nodes[start][:8]} ({self.ips[start]})")
                start = rank
        return ", ".join(parts)


def _claim_gpus(pool: str, count: int) -> list[int]:
    """The `count` lowest GPU ids of this machine not held by another pool."""
    with _claims_lock:
        available = torch.cuda.device_count()
        free = [i for i in range(available) if i not in _claimed_gpus]
        if len(free) < count:
            held = {p: sorted(g for g, q in _claimed_gpus.items() if q == p) for p in set(_claimed_gpus.values())}
            raise ValueError(
                f"ResourcePool '{pool}' needs {count} GPU(s) but this machine has {available} "
                f"(torch.cuda.device_count()), {len(free)} of them free"
                + (f"; held by other pools: {held}" if held else "")
                + f". Use at most {len(free)} processes, or device='cpu'"
            )
        for gpu in free[:count]:
            _claimed_gpus[gpu] = pool
        return free[:count]


def _release_gpus(pool: str) -> None:
    with _claims_lock:
        for gpu in [g for g, p in _claimed_gpus.items() if p == pool]:
            del _claimed_gpus[gpu]
