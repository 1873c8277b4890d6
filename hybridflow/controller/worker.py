"""`Worker`: the base class of every role that lives inside a worker-group process.

The backend fills in the worker's place in its group (`rank`, `world_size`, `local_rank`,
`device`, `process_group`, `role`, `host`) and initialises torch.distributed *before* the subclass'
`__init__` runs, so `__init__` can already build sharded models. Methods become callable from the
controller with `@register(Dispatch.X)` (see `hybridflow.controller.dispatch`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.controller.dispatch import Dispatch, register


@dataclass(frozen=True)
class WorkerContext:
    """A worker's place in its group, as seen from inside its process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    role: str
    process_group: Any = None
    host: str = "127.0.0.1"


class Worker:
    """Base class of worker roles.

    Attributes available from `__init__` on:
        rank, world_size, local_rank: the process' position in its group.
        device: ``torch.device("cuda:<local_rank>")`` in GPU groups, ``torch.device("cpu")`` otherwise.
        process_group: the group's torch.distributed process group.
        role: the group's name (e.g. ``"actor"``), or the member name inside a colocated worker.
        host: the address other processes reach this worker's machine on (loopback on the local
            backend, the node's IP on Ray), for servers a worker hosts (e.g. the weight-sync store).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    role: str
    process_group: Any
    host: str

    @classmethod
    def create(cls, context: WorkerContext, init_kwargs: dict | None = None) -> Worker:
        """Builds an instance whose context attributes are set before `__init__(**init_kwargs)` runs.

        Backends call this; tests may too, to build a worker in-process from a hand-made context."""
        obj = cls.__new__(cls)
        obj._bind(context)
        cls.__init__(obj, **(init_kwargs or {}))
        return obj

    def _bind(self, context: WorkerContext) -> None:
        self.rank, self.world_size, self.local_rank = context.rank, context.world_size, context.local_rank
        self.device, self.role, self.process_group = context.device, context.role, context.process_group
        self.host = context.host

    @register(Dispatch.BROADCAST, collect="all")
    def get_pid(self) -> int:
        """This worker's process id; ``group.pids()`` returns one per rank."""
        return os.getpid()
