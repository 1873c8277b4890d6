"""The worker side of every backend: join the group's process group, build the worker, run calls.

`WorkerSpec` is what the controller sends to each process; `WorkerRuntime` lives in the worker
process (or in the controller for inline groups) and turns ``(method, args, kwargs)`` into a reply
``("ok", value)`` or ``("error", formatted traceback)``.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller.dispatch import dispatch_spec
from hybridflow.controller.worker import Worker, WorkerContext

Reply = tuple[str, Any]
INIT_TIMEOUT = timedelta(minutes=10)


@dataclass
class WorkerSpec:
    """Everything a worker process needs to build its role (pickled once per process)."""

    worker_cls: type[Worker]
    role: str
    world_size: int
    device_type: str
    init_kwargs: dict = field(default_factory=dict)

    def dumps(self, pickler: Any = pickle) -> tuple[list[str], bytes]:
        """``(controller sys.path, pickled spec)``: the path must be applied before unpickling.

        `pickler` is a module with ``dumps`` (``pickle``, or cloudpickle for workers that cannot
        import the controller's ``__main__``)."""
        return list(sys.path), pickler.dumps(self)


def load_spec(sys_path: list[str], blob: bytes) -> WorkerSpec:
    """Inverse of `WorkerSpec.dumps`, run in the worker (the controller's import paths first)."""
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    return pickle.loads(blob)


def dist_backend(device_type: str) -> str:
    """gloo for CPU groups; NCCL for CUDA tensors plus gloo for CPU ones in GPU groups."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def join_process_group(spec: WorkerSpec, rank: int, store_addr: tuple[str, int]) -> None:
    """Initialises the default process group of a worker process from the group's TCP store.

    Ranks of a CPU group share the machine's cores: each gets its share of OpenMP threads."""
    if spec.device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    store = dist.TCPStore(store_addr[0], store_addr[1], spec.world_size, is_master=False, timeout=INIT_TIMEOUT)
    dist.init_process_group(
        dist_backend(spec.device_type), store=store, rank=rank, world_size=spec.world_size, timeout=INIT_TIMEOUT
    )


def ensure_single_process_group(device_type: str) -> None:
    """The controller's own world-size-1 default group, shared by every inline group (made once)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"inline worker groups need a world-size-1 default process group, but this process "
                f"already belongs to one of size {dist.get_world_size()}; use inline=False"
            )
        return
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group(dist_backend(device_type), store=dist.HashStore(), rank=0, world_size=1)


class WorkerRuntime:
    """Owns the worker instance inside its process; the process group must already exist."""

    def __init__(self, spec: WorkerSpec, rank: int, local_rank: int, device: torch.device,
                 host: str = "127.0.0.1") -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        context = WorkerContext(rank, spec.world_size, local_rank, device, spec.role, dist.group.WORLD, host)
        self.spec = spec
        self.worker = spec.worker_cls.create(context, spec.init_kwargs)

    def resolve(self, path: str) -> Any:
        """``"method"`` or ``"member.method"`` (colocated) -> the bound, registered method."""
        owner: Any = self.worker
        *members, name = path.split(".")
        for member in members:
            owner = owner.instances[member]
        if dispatch_spec(type(owner), name) is None:
            raise AttributeError(f"{type(owner).__name__}.{name} is not a registered worker method")
        return getattr(owner, name)

    def call(self, path: str, args: tuple, kwargs: dict) -> Reply:
        """Runs one method; never raises (errors come back as their formatted traceback)."""
        try:
            result = self.resolve(path)(*args, **kwargs)
            if isinstance(result, Batch):
                result = result.to("cpu")
            return ("ok", result)
        except BaseException:  # noqa: BLE001 - every failure is reported to the controller
            return ("error", traceback.format_exc())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
