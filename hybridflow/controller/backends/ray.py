"""The Ray backend: one Ray actor per rank, placed on its pool's placement group (one bundle per
node, spread over distinct nodes). Ray is imported here only, lazily, so the rest of hybridflow works without it.

Calls travel as our own pickles (the same bytes as the local backend), so both backends give the
same results; output forwarding, `WorkerError` and `WorkerDiedError` behave as in `local`.
"""

from __future__ import annotations

import itertools
import os
import pickle
import threading
import traceback
import uuid
from concurrent.futures import Future
from typing import Any

import torch

from hybridflow.controller.backends import Backend, settle, wait_all
from hybridflow.controller.errors import WorkerDiedError
from hybridflow.controller.logs import forward_output, log_server, mark_synced
from hybridflow.controller.runtime import WorkerRuntime, join_process_group, load_spec

PLACEMENT_TIMEOUT_S = 120.0


def import_ray() -> Any:
    """`ray`, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "backend='ray' needs the ray package: pip install 'hybridflow[ray]' (or use backend='local')"
        ) from exc
    return ray


class RayWorkerActor:
    """The body of each Ray actor: the same `WorkerRuntime` the local backend runs in a process."""

    def __init__(self, sys_path: list[str], blob: bytes, rank: int, log_addr: tuple[str, int], log_key: str) -> None:
        self.spec = load_spec(sys_path, blob)
        self.rank = rank
        self.runtime: WorkerRuntime | None = None
        self.store: Any = None
        forward_output(log_addr, f"({self.spec.role} rank {rank}) ", log_key)

    def node_info(self) -> tuple[str, list[str]]:
        """(node IP, GPU ids Ray assigned to this actor)."""
        ray = import_ray()
        return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def host_store(self) -> int:
        """Rank 0 hosts the group's TCP store; returns its port."""
        import torch.distributed as dist

        self.store = dist.TCPStore(
            self.node_info()[0], 0, self.spec.world_size, is_master=True, wait_for_workers=False
        )
        return self.store.port

    def setup(self, store_addr: tuple[str, int], local_rank: int, visible_gpus: str) -> tuple[str, Any]:
        """Joins the process group and builds the worker; returns a reply like every call."""
        try:
            if self.spec.device_type == "cuda":
                os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
            join_process_group(self.spec, self.rank, store_addr)
            cuda = self.spec.device_type == "cuda"
            device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
            self.runtime = WorkerRuntime(self.spec, self.rank, local_rank, device)
            reply: tuple[str, Any] = ("ok", os.getpid())
        except BaseException:  # noqa: BLE001 - reported to the controller as a WorkerError
            reply = ("error", traceback.format_exc())
        mark_synced(0)
        return reply

    def call(self, path: str, call_id: int, payload: bytes) -> bytes:
        try:
            args, kwargs = pickle.loads(payload)
            data = pickle.dumps(self.runtime.call(path, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - e.g. a result that cannot be pickled
            data = pickle.dumps(("error", traceback.format_exc()))
        mark_synced(call_id)
        return data


def _placement_group(ray: Any, pool: Any) -> Any:
    """The pool's placement group (made on first use): one bundle per node holding that node's slots,
    so rank ``r`` lives on node ``r // pool.per_node`` and a node's ranks are consecutive."""
    if pool.placement is None:
        from ray.util.placement_group import placement_group

        gpus = ray.cluster_resources().get("GPU", 0)
        if pool.device == "cuda" and gpus < pool.n_processes:
            raise ValueError(
                f"{pool!r} needs {pool.n_processes} GPUs but the Ray cluster has {gpus:g}; "
                f"use at most {int(gpus)} processes, or device='cpu'"
            )

        bundle = {"CPU": pool.cpus_per_process * pool.per_node}
        if pool.device == "cuda":
            bundle["GPU"] = pool.per_node
        strategy = "STRICT_SPREAD" if pool.nodes > 1 else "PACK"
        pg = placement_group([dict(bundle) for _ in range(pool.nodes)], strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"Ray could not place {pool!r}: {pool.nodes} bundle(s) of {bundle} "
                f"(strategy {strategy}) did not fit within {PLACEMENT_TIMEOUT_S:.0f} s; cluster has "
                f"{ray.cluster_resources()}. Use a smaller pool or a lower cpus_per_process"
            )
        pool.placement = pg
    return pool.placement


class RayBackend(Backend):
    """A group of Ray actors, one per rank of the pool."""

    def start(self) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._dead: dict[int, WorkerDiedError] = {}
        self._pids: list[int] = []
        self._uid = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        pg = _placement_group(ray, self.pool)
        actor_cls = ray.remote(RayWorkerActor)
        sys_path, blob = self.spec.dumps(ray.cloudpickle)  # classes of the driver's __main__ travel by value
        self._logs = log_server(ray.util.get_node_ip_address())
        log_addr = self._logs.address
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if self.spec.device_type == "cuda":
            options["num_gpus"] = 1
        if self.env:
            options["runtime_env"] = {"env_vars": dict(self.env)}
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank // self.pool.per_node
                ),
                **options,
            ).remote(sys_path, blob, rank, log_addr, f"{self._uid}-{rank}")
            for rank in range(self.world_size)
        ]
        try:
            self._setup()
        except BaseException:
            self.shutdown()
            raise

    def _setup(self) -> None:
        ray = self._ray
        infos = ray.get([a.node_info.remote() for a in self.actors])
        port = ray.get(self.actors[0].host_store.remote())
        local_ranks, node_ranks, node_gpus = [], {}, {}
        for ip, gpus in infos:
            local_ranks.append(node_ranks.get(ip, 0))
            node_ranks[ip] = local_ranks[-1] + 1
            node_gpus.setdefault(ip, []).extend(gpus)
        replies = [
            self._wrap(rank, 0, "__init__", actor.setup.remote((infos[0][0], port), local_ranks[rank], gpus), False)
            for rank, actor in enumerate(self.actors)
            for gpus in [",".join(node_gpus[infos[rank][0]])]
        ]
        self._pids = wait_all(replies)

    def _wrap(self, rank: int, call_id: int, path: str, ref: Any, pickled: bool) -> Future:
        """Turns an actor ObjectRef into a Future of the reply's value (errors translated)."""
        out: Future = Future()

        def done(raw: Future) -> None:
            try:
                reply = raw.result()
            except self._ray.exceptions.RayActorError as exc:
                pid = self._pids[rank] if rank < len(self._pids) else "unknown"
                how = f"pid {pid}, its Ray actor died"
                error = WorkerDiedError(self.spec.role, rank, how, str(exc).splitlines()[0])
                with self._lock:
                    self._dead.setdefault(rank, error)
                out.set_exception(error)
                return
            except BaseException as exc:  # noqa: BLE001 - any Ray failure fails the call
                out.set_exception(exc)
                return
            self._logs.wait_synced(f"{self._uid}-{rank}", call_id)
            settle(out, pickle.loads(reply) if pickled else reply, self.spec.role, rank, path)

        ref.future().add_done_callback(done)
        return out

    def submit(self, rank: int, path: str, encoded: bytes, blocking: bool) -> Future:
        with self._lock:
            dead = self._dead.get(rank)
        if dead is not None:
            future: Future = Future()
            future.set_exception(dead)
            return future
        call_id = next(self._ids)
        return self._wrap(rank, call_id, path, self.actors[rank].call.remote(path, call_id, encoded), True)

    def shutdown(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)
        self.actors = []
        if self.pool.groups == [self.spec.role] and self.pool.placement is not None:
            self._ray.util.remove_placement_group(self.pool.placement)
            self.pool.placement = None
