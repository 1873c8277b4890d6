"""Backends run a worker group's processes: `local` (torch.multiprocessing, or in-process for one
worker) and `ray` (actors in a placement group). They share one small interface, `Backend`."""

from __future__ import annotations

import pickle
from concurrent.futures import FIRST_EXCEPTION, Future, InvalidStateError, wait
from typing import Any

from hybridflow.controller.errors import WorkerError
from hybridflow.controller.resource_pool import Placement, ResourcePool
from hybridflow.controller.runtime import Reply, WorkerSpec


class Backend:
    """Starts the group's workers and runs one method call on one rank at a time per call.

    A call is first `encode`d for every rank (so an argument that cannot travel fails before any
    rank starts), then `submit`ted; the Future resolves to the rank's return value, or fails with
    `WorkerError` (the method raised) or `WorkerDiedError` (the process ended, or, with `worker_timeout_s`,
    fell silent: `hybridflow.controller.liveness`).
    """

    def __init__(self, spec: WorkerSpec, pool: ResourcePool, env: dict[str, str],
                 worker_timeout_s: float | None = None) -> None:
        self.spec, self.pool, self.env = spec, pool, dict(env)
        self.worker_timeout_s = worker_timeout_s or None

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def start(self) -> None:
        raise NotImplementedError

    def encode(self, args: tuple, kwargs: dict) -> Any:
        """One rank's arguments in the form `submit` sends (pickled bytes for process backends)."""
        return pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)

    def submit(self, rank: int, path: str, encoded: Any, blocking: bool) -> Future:
        raise NotImplementedError

    def placement(self) -> Placement:
        """Where the ranks run (every rank on this machine unless the backend places them elsewhere)."""
        return Placement(["local"] * self.world_size, ["127.0.0.1"] * self.world_size)

    def shutdown(self) -> None:
        raise NotImplementedError


def settle(future: Future, reply: Reply, role: str, rank: int, path: str) -> None:
    """Completes `future` from a worker reply ``("ok", value)`` / ``("error", traceback)``, unless it was
    already failed (its rank was given up as unresponsive)."""
    status, value = reply
    try:
        if status == "ok":
            future.set_result(value)
        else:
            future.set_exception(WorkerError(role, rank, path, value))
    except InvalidStateError:
        pass


def wait_all(futures: list[Future]) -> list[Any]:
    """Every future's result, raising the first failure as soon as it happens (a rank stuck in a
    collective because another rank failed must not hide that failure)."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    for future in futures:
        error = future.exception() if future in done else None
        if error is not None:
            raise error
    return [f.result() for f in futures]


def make_backend(name: str, spec: WorkerSpec, pool: ResourcePool, env: dict[str, str], inline: bool | None,
                 worker_timeout_s: float | None = None) -> Any:
    """The backend called `name` ("local" or "ray") for one group (`worker_timeout_s`: see `Backend`; an
    inline group runs in the controller and is not watched)."""
    if name == "local":
        if inline is None:
            inline = spec.world_size == 1
        if inline:
            if spec.world_size != 1:
                raise ValueError(f"inline=True needs n_workers=1 (group '{spec.role}' has {spec.world_size})")
            from hybridflow.controller.backends.inline import InlineBackend

            return InlineBackend(spec, pool, env)
        from hybridflow.controller.backends.local import LocalBackend

        return LocalBackend(spec, pool, env, worker_timeout_s)
    if name == "ray":
        if inline:
            raise ValueError("inline=True is a local-backend option; the ray backend always uses actors")
        from hybridflow.controller.backends.ray import RayBackend

        return RayBackend(spec, pool, env, worker_timeout_s)
    raise ValueError(f"unknown backend {name!r}; valid: 'local', 'ray'")
