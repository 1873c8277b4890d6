"""The controller layer: workers, the `@register` dispatch decorator, worker groups, resource pools
and the `local` / `ray` backends. See docs/workers.md."""

from hybridflow.controller.backends import wait_all
from hybridflow.controller.colocate import colocate
from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.errors import WorkerDiedError, WorkerError, WorkerUnresponsiveError
from hybridflow.controller.group import MemberView, Remote, WorkerGroup, per_rank, remote, submit
from hybridflow.controller.resource_pool import Placement, ResourcePool
from hybridflow.controller.worker import Worker

__all__ = [
    "Dispatch",
    "MemberView",
    "Placement",
    "Remote",
    "ResourcePool",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerUnresponsiveError",
    "colocate",
    "per_rank",
    "register",
    "remote",
    "submit",
    "wait_all",
]
