"""`WorkerGroup`: the controller's handle on an SPMD group of workers running one role.

``group.method(*args)`` scatters the call over the ranks as the method's `@register` says, blocks,
and returns the collected result; ``group.method.submit(*args)`` returns a Future instead, so
several groups can work at once. Groups built from `colocate(...)` expose each member role as an
attribute: ``group.actor.update(batch)``.

`Remote[W]` is how code that holds a handle on a group of `W` workers types it (`Remote[ActorWorker]`):
a type checker and an editor see the worker class itself, so go-to-definition from
``roles.actor.update_actor(batch)`` reaches `ActorWorker.update_actor`, and a call takes the method's
arguments and returns its result, collected as its `@register` says (a Batch, or one value with
``collect="same"``). At run time the object is a `WorkerGroup[W]` or a `MemberView[W]`; ``.submit`` exists
only there: typed code starts a call with `submit(handle.method, *args)`, which a type checker reads as the
method's own signature and result. A method that collects one result per rank is reached through
`per_rank(handle.method)`, typed as the list it returns.
"""

from __future__ import annotations

import atexit
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Annotated, Any, Generic, ParamSpec, TypeVar, cast

from hybridflow.controller.backends import make_backend
from hybridflow.controller.colocate import ColocatedWorker
from hybridflow.controller.dispatch import Dispatch, DispatchSpec, gather, registered_methods, scatter
from hybridflow.controller.errors import WorkerError
from hybridflow.controller.resource_pool import Placement, ResourcePool
from hybridflow.controller.runtime import WorkerSpec
from hybridflow.controller.worker import Worker

W = TypeVar("W", bound=Worker)
P = ParamSpec("P")
R = TypeVar("R")
Remote = Annotated[W, "a WorkerGroup or MemberView dispatching each call over the ranks"]

_live_groups: weakref.WeakSet = weakref.WeakSet()
_INSTANCE_ATTRS = {"name", "worker_cls", "pool"}


CAUSE_GRACE_S = 5.0


def _combine(parts: list[Future], finish: Any) -> Future:
    """One Future over the per-rank futures: `finish(results)` when all succeed, else a failure.

    A rank's death fails it at once. A method that raised fails it when the other ranks are done, or after
    `CAUSE_GRACE_S`: when a rank dies, its peers' collectives break and usually report before the death is
    known, and the death (role, rank, node) is the error worth reading."""
    out: Future = Future()
    results: list[Any] = [None] * len(parts)
    remaining = [len(parts)]
    raised: list[BaseException] = []
    lock = threading.Lock()

    def fail(error: BaseException) -> None:
        with lock:
            if not out.done():
                out.set_exception(error)

    def on_done(index: int, part: Future) -> None:
        error = part.exception()
        with lock:
            if out.done():
                return
            remaining[0] -= 1
            if error is not None and not isinstance(error, WorkerError):
                out.set_exception(error)
                return
            if error is not None:
                raised.append(error)
                if len(raised) == 1 and remaining[0]:
                    timer = threading.Timer(CAUSE_GRACE_S, fail, args=(error,))
                    timer.daemon = True
                    timer.start()
            else:
                results[index] = part.result()
            if remaining[0]:
                return
            if raised:
                out.set_exception(raised[0])
                return
        try:
            out.set_result(finish(results))
        except InvalidStateError:
            pass
        except Exception as exc:  # noqa: BLE001 - a collect error belongs to the caller
            out.set_exception(exc)

    for i, part in enumerate(parts):
        part.add_done_callback(functools.partial(on_done, i))
    return out


class RemoteMethod:
    """A registered worker method seen from the controller: call it, or `.submit(...)` it."""

    def __init__(self, group: WorkerGroup, path: str, spec: DispatchSpec) -> None:
        self._group, self._path, self._spec = group, path, spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._group._submit(self._path, self._spec, args, kwargs, blocking=True).result()

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        """Starts the call and returns a Future of the collected result."""
        return self._group._submit(self._path, self._spec, args, kwargs, blocking=False)

    def __repr__(self) -> str:
        return f"<{self._spec.mode} method '{self._path}' of group '{self._group.name}'>"


def remote(handle: WorkerGroup[W] | MemberView[W]) -> Remote[W]:
    """`handle` as the `Remote[W]` a controller keeps (the worker class itself, to a type checker)."""
    return cast(W, handle)


def submit(method: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
    """Starts `method` (a worker method reached through a `Remote` handle: ``submit(roles.actor.update_actor,
    batch)``) and returns a Future of its collected result; the same as ``method.submit(...)``, with the
    method's own argument and result types for a type checker."""
    if not isinstance(method, RemoteMethod):
        raise TypeError(f"submit() takes a method of a WorkerGroup or MemberView (group.method), got {method!r}")
    return method.submit(*args, **kwargs)


def per_rank(method: Callable[P, R]) -> Callable[P, list[R]]:
    """`method` (a worker method reached through a `Remote` handle) typed as what a call of it returns when it
    collects one result per rank (`Dispatch.BROADCAST` with ``collect="all"``, `Dispatch.PER_RANK`, or
    `Dispatch.DATA_PARALLEL` with results that are not Batches): the list of them, in rank order. Call it or
    `submit` it: ``submit(per_rank(roles.rollout.in_flight), version)``. A method that collects one result is
    refused."""
    if not isinstance(method, RemoteMethod):
        raise TypeError(f"per_rank() takes a method of a WorkerGroup or MemberView (group.method), got {method!r}")
    spec = method._spec
    if spec.collect == "same" or spec.mode is Dispatch.RANK_ZERO or (
            spec.mode is Dispatch.BROADCAST and spec.collect == "default"):
        raise TypeError(f"{method!r} collects one result (collect={spec.collect!r}), not one per rank; call it "
                        f"without per_rank()")
    return cast(Callable[P, list[R]], method)


def _lookup(cls: type, owner: str, name: str) -> DispatchSpec:
    methods = registered_methods(cls)
    if name in methods:
        return methods[name]
    listed = ", ".join(methods) or "none"
    if hasattr(cls, name):
        raise AttributeError(
            f"{cls.__name__}.{name} is not callable from the controller ({owner}): decorate it with "
            f"@register(Dispatch...). Registered methods: {listed}"
        )
    raise AttributeError(f"{cls.__name__} has no method '{name}' ({owner}); registered methods: {listed}")


class MemberView(Generic[W]):
    """One member role of a colocated group: ``group.ref.compute_log_probs(batch)``."""

    def __init__(self, group: WorkerGroup, member: str, cls: type[W]) -> None:
        self._group, self._member, self._cls = group, member, cls

    def __getattr__(self, name: str) -> RemoteMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        spec = _lookup(self._cls, f"member '{self._member}' of group '{self._group.name}'", name)
        return RemoteMethod(self._group, f"{self._member}.{name}", spec)


class WorkerGroup(Generic[W]):
    """`n_workers` processes running `worker_cls`, addressed as one object by the controller.

    Args:
        worker_cls: a `Worker` subclass, or a class made by `colocate(...)`.
        n_workers: processes (ranks) in the group.
        backend: ``"local"`` (processes on this machine; in-process for one worker) or ``"ray"``.
        device: ``"cpu"`` or ``"cuda"``; defaults to the pool's device, else ``"cpu"``.
        name: the role name used in worker prefixes, errors and ``Worker.role``.
        init_kwargs: keyword arguments of ``worker_cls.__init__`` (for colocated classes: a dict
            of member name -> kwargs).
        pool: the `ResourcePool` to place the group on (default: a private pool of `n_workers`).
        env: environment variables set in every worker process.
        inline: local backend only; None = in-process when ``n_workers == 1``.
        worker_timeout_s: when set, a worker process that sends no heartbeat for this many seconds while a
            call to it is pending fails the call with `WorkerUnresponsiveError` (`controller.liveness`).
    """

    def __init__(
        self,
        worker_cls: type[W],
        n_workers: int = 1,
        backend: str = "local",
        device: str | None = None,
        name: str = "actor",
        init_kwargs: dict | None = None,
        pool: ResourcePool | None = None,
        env: dict[str, str] | None = None,
        inline: bool | None = None,
        worker_timeout_s: float | None = None,
    ) -> None:
        self._backend = None
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"WorkerGroup needs a Worker subclass, got {worker_cls!r}")
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
        if backend not in ("local", "ray"):
            raise ValueError(f"unknown backend {backend!r}; valid: 'local', 'ray'")
        if issubclass(worker_cls, ColocatedWorker):
            clashes = [m for m in worker_cls.members if hasattr(WorkerGroup, m) or m in _INSTANCE_ATTRS]
            if clashes:
                raise ValueError(f"colocated member names {clashes} clash with WorkerGroup attributes; rename them")
        self.name, self.worker_cls = name, worker_cls
        self._own_pool = pool is None
        self.pool = pool or ResourcePool(n_workers, device or "cpu", name=f"{name}-pool")
        device = device or self.pool.device
        if device != self.pool.device:
            raise ValueError(f"group '{name}' wants device '{device}' but {self.pool!r} is '{self.pool.device}'")
        self.pool.attach(name, n_workers, backend)
        self._submit_lock = threading.Lock()
        spec = WorkerSpec(worker_cls, name, n_workers, device, dict(init_kwargs or {}))
        try:
            backend_obj = make_backend(backend, spec, self.pool, env or {}, inline, worker_timeout_s)
            backend_obj.start()
        except BaseException:
            self.pool.detach(name)
            raise
        self._backend = backend_obj
        _live_groups.add(self)

    def _started(self) -> Any:
        """The running backend; a group that is shut down says so."""
        if self._backend is None:
            raise RuntimeError(f"worker group '{self.name}' is shut down")
        return self._backend

    @property
    def world_size(self) -> int:
        return self._started().world_size

    def pids(self) -> list[int]:
        """Process id of each rank (the controller's own pid for inline groups)."""
        return self.get_pid()

    def placement(self) -> Placement:
        """Each rank's node and the address the group's process group met at."""
        return self._started().placement()

    def __getattr__(self, name: str) -> Any:
        cls = self.__dict__.get("worker_cls")
        if name.startswith("_") or cls is None:
            raise AttributeError(name)
        if issubclass(cls, ColocatedWorker) and name in cls.members:
            return MemberView(self, name, cls.members[name])
        try:
            return RemoteMethod(self, name, _lookup(cls, f"group '{self.name}'", name))
        except AttributeError as exc:
            if issubclass(cls, ColocatedWorker):
                raise AttributeError(f"{exc}; colocated members: {', '.join(cls.members)}") from None
            raise

    def _submit(self, path: str, spec: DispatchSpec, args: tuple, kwargs: dict, blocking: bool) -> Future:
        if self._backend is None:
            raise RuntimeError(f"worker group '{self.name}' is shut down")
        scattered = scatter(spec, path, args, kwargs, self.world_size)
        encoded = [self._backend.encode(a, k) for _, a, k in scattered.calls]
        with self._submit_lock:  # every rank sees calls in the same order
            parts = [self._backend.submit(r, path, e, blocking) for (r, _, _), e in zip(scattered.calls, encoded)]
        return _combine(parts, lambda results: gather(spec, path, scattered, results))

    def shutdown(self) -> None:
        """Stops every worker process and frees the group's slots of its pool (idempotent)."""
        backend, self._backend = self._backend, None
        if backend is None:
            return
        _live_groups.discard(self)
        try:
            backend.shutdown()
        finally:
            self.pool.detach(self.name)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._backend is None else f"{self.world_size} workers"
        return f"WorkerGroup('{self.name}', {self.worker_cls.__name__}, {state}, {self.pool!r})"


@atexit.register
def _shutdown_all() -> None:
    for group in list(_live_groups):
        group.shutdown()
