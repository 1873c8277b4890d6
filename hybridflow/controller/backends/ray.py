"""The Ray backend: one Ray actor per rank, placed on its pool's placement group (one bundle per share
of the pool, `hybridflow.controller.cluster.pool_bundle`; rank ``r`` in share ``r // per_node``). Ray is
imported lazily, so the rest of hybridflow works without it.

The group's process group meets at a TCP store its rank-0 actor hosts on its own node, so a group on
other machines never needs the controller's address. Calls travel as our own pickles (the same bytes as
the local backend), so both backends give the same results; output forwarding, `WorkerError` and
`WorkerDiedError` behave as in `local`, and a dead actor's error names its node.
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
from hybridflow.controller.cluster import RAY_STRATEGY, alive_nodes, check_capacity, connect, pool_bundle
from hybridflow.controller.errors import WorkerDiedError
from hybridflow.controller.liveness import Liveness, fail
from hybridflow.controller.logs import forward_output, log_server, mark_synced, prefix
from hybridflow.controller.resource_pool import Placement
from hybridflow.controller.runtime import WorkerRuntime, join_process_group, load_spec
from hybridflow.utils.stop_signals import ignore_stop_signals

PLACEMENT_TIMEOUT_S = 120.0


class RayWorkerActor:
    """The body of each Ray actor: the same `WorkerRuntime` the local backend runs in a process."""

    def __init__(self, sys_path: list[str], blob: bytes, rank: int, log_addr: tuple[str, int], log_key: str) -> None:
        ignore_stop_signals()
        self.spec = load_spec(sys_path, blob)
        self.rank = rank
        self.runtime: WorkerRuntime | None = None
        self.store: Any = None
        forward_output(log_addr, prefix(self.spec.role, rank), log_key)

    def node_info(self) -> tuple[str, str, list[str]]:
        """(node id, node IP, GPU ids Ray assigned to this actor)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ray.get_runtime_context().get_node_id(), ip, [str(g) for g in ray.get_gpu_ids()]

    def host_store(self) -> int:
        """Rank 0 hosts the group's TCP store on its node; returns its port."""
        import torch.distributed as dist

        self.store = dist.TCPStore(
            self.node_info()[1], 0, self.spec.world_size, is_master=True, wait_for_workers=False
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
            self.runtime = WorkerRuntime(self.spec, self.rank, local_rank, device, host=self.node_info()[1])
            reply: tuple[str, Any] = ("ok", os.getpid())
        except BaseException:  # noqa: BLE001 - reported to the controller as a WorkerError
            reply = ("error", traceback.format_exc())
        mark_synced(0)
        return reply

    def call(self, path: str, call_id: int, payload: bytes) -> bytes:
        try:
            if self.runtime is None:
                raise RuntimeError(f"{path} was called before this Ray actor's worker was built")
            args, kwargs = pickle.loads(payload)
            data = pickle.dumps(self.runtime.call(path, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - e.g. a result that cannot be pickled
            data = pickle.dumps(("error", traceback.format_exc()))
        mark_synced(call_id)
        return data


def _placement_group(ray: Any, pool: Any) -> Any:
    """The pool's placement group (made on first use, after `check_capacity` has found room for it)."""
    if pool.placement is None:
        from ray.util.placement_group import placement_group

        check_capacity([pool], alive_nodes(ray))
        bundle, strategy = pool_bundle(pool), RAY_STRATEGY[pool.strategy]
        pg = placement_group([dict(bundle) for _ in range(pool.nodes)], strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"Ray could not place {pool!r}: {pool.nodes} bundle(s) of {bundle} (strategy {strategy}) did "
                f"not fit within {PLACEMENT_TIMEOUT_S:.0f} s although the cluster's nodes can hold them: other "
                f"jobs hold part of {ray.cluster_resources()}. Free them, or use a smaller pool"
            )
        pool.placement = pg
    return pool.placement


class RayBackend(Backend):
    """A group of Ray actors, one per rank of the pool."""

    def start(self) -> None:
        ray = connect()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._dead: dict[int, Exception] = {}
        self._pids: list[int] = []
        self._placement = Placement([], [])
        self._uid = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._liveness = None
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
        if self.worker_timeout_s:
            keys = [f"{self._uid}-{rank}" for rank in range(self.world_size)]
            self._liveness = Liveness(self.spec.role, self._logs, keys, self._where, self.worker_timeout_s,
                                      self._give_up)
        try:
            self._setup()
        except BaseException:
            self.shutdown()
            raise

    def _give_up(self, rank: int, error: Exception) -> None:
        """`Liveness` found the rank silent: later calls to it fail at once."""
        with self._lock:
            self._dead.setdefault(rank, error)

    def _setup(self) -> None:
        ray = self._ray
        infos = ray.get([a.node_info.remote() for a in self.actors])
        port = ray.get(self.actors[0].host_store.remote())
        self._placement = Placement([i[0] for i in infos], [i[1] for i in infos], (infos[0][1], port))
        local_ranks: list[int] = []
        node_ranks: dict[str, int] = {}
        node_gpus: dict[str, list[str]] = {}
        for node, _, gpus in infos:  # ranks of one node count 0, 1, ... and see all its GPUs of this group
            local_ranks.append(node_ranks.get(node, 0))
            node_ranks[node] = local_ranks[-1] + 1
            node_gpus.setdefault(node, []).extend(gpus)
        replies = [
            self._wrap(rank, 0, "__init__", actor.setup.remote(self._placement.master, local_ranks[rank], gpus), False)
            for rank, actor in enumerate(self.actors)
            for gpus in [",".join(node_gpus[infos[rank][0]])]
        ]
        self._pids = wait_all(replies)

    def placement(self) -> Placement:
        return self._placement

    def _wrap(self, rank: int, call_id: int, path: str, ref: Any, pickled: bool) -> Future:
        """Turns an actor ObjectRef into a Future of the reply's value (errors translated)."""
        out: Future = Future()

        def done(raw: Future) -> None:
            try:
                reply = raw.result()
            except self._ray.exceptions.RayActorError as exc:
                lost = isinstance(exc, self._ray.exceptions.ActorUnavailableError)  # max_restarts=0: never back
                how = ", its Ray actor " + ("stopped answering (its process or node is gone)" if lost else "died")
                error = WorkerDiedError(self.spec.role, rank, self._where(rank) + how, _reason(exc))
                with self._lock:
                    self._dead.setdefault(rank, error)
                fail(out, error)
                return
            except BaseException as exc:  # noqa: BLE001 - any Ray failure fails the call
                fail(out, exc)
                return
            self._logs.wait_synced(f"{self._uid}-{rank}", call_id)
            settle(out, pickle.loads(reply) if pickled else reply, self.spec.role, rank, path)

        ref.future().add_done_callback(done)
        return out

    def _where(self, rank: int) -> str:
        """``pid 4242 on node 3f2a1c0d (10.0.0.2)``, as far as the rank got before dying."""
        pid = self._pids[rank] if rank < len(self._pids) else "unknown"
        nodes, ips = self._placement.nodes, self._placement.ips
        return f"pid {pid}" + (f" on node {nodes[rank][:8]} ({ips[rank]})" if rank < len(nodes) else "")

    def submit(self, rank: int, path: str, encoded: bytes, blocking: bool) -> Future:
        with self._lock:
            dead = self._dead.get(rank)
        if dead is not None:
            future: Future = Future()
            future.set_exception(dead)
            return future
        call_id = next(self._ids)
        future = self._wrap(rank, call_id, path, self.actors[rank].call.remote(path, call_id, encoded), True)
        if self._liveness is not None:
            self._liveness.track(rank, future, path)
        return future

    def shutdown(self) -> None:
        if self._liveness is not None:
            self._liveness.close()
        if not self._ray.is_initialized():  # Ray went first (ray.shutdown()): its actors went with it
            self.actors, self.pool.placement = [], None
            return
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)
        self.actors = []
        if self.pool.groups == [self.spec.role] and self.pool.placement is not None:
            self._ray.util.remove_placement_group(self.pool.placement)
            self.pool.placement = None


def _reason(exc: BaseException) -> str:
    """Ray's own account of an actor's death: its first line and the line saying why (e.g. "The actor
    died because its node has died"), without the actor ids and namespaces around them."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = [line for line in lines[1:] if "because" in line or ("node" in line.lower() and "died" in line)]
    return "\n".join(lines[:1] + why[:2])
