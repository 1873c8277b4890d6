"""Ray clusters seen from the controller: joining one (`connect`), what its alive nodes hold
(`alive_nodes`), the placement-group bundle each share of a `ResourcePool` reserves on its node
(`pool_bundle`), refusing up front, with the numbers, pools the cluster cannot hold (`check_capacity`, so
a run fails before any model loads instead of waiting on Ray), and asking nodes whether they see a path
(`unseen_on`).

Ray is imported lazily (`import_ray`), so the rest of hybridflow works without it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.controller.resource_pool import ResourcePool

PIN_AMOUNT = 0.001  # how much of its node's custom resource one share of a pinned pool takes
_EPS = 1e-4  # Ray keeps resource amounts to 4 decimals
RAY_STRATEGY = {"spread": "STRICT_SPREAD", "pack": "PACK"}


class CapacityError(ValueError):
    """The Ray cluster cannot hold the pools asked for; the message gives the numbers and what to change."""


def import_ray() -> Any:
    """`ray`, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "backend='ray' needs the ray package: pip install 'hybridflow[ray]' (or use backend='local')"
        ) from exc
    return ray


def connect(address: str | None = None) -> Any:
    """`ray`, joined to a cluster: the one this process has already joined, else `ray.init(address)`:
    None joins `RAY_ADDRESS` or the cluster last started with `ray start` on this machine, or starts a
    local one; ``"auto"`` joins an existing cluster or fails; ``"HOST:PORT"`` joins that head node."""
    ray = import_ray()
    if not ray.is_initialized():
        with stop_signals_blocked():
            ray.init(address=address, include_dashboard=False)
    return ray


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Blocks SIGINT and SIGTERM in this thread while `ray.init` may start a local Ray instance: its processes
    (GCS, raylet, workers) inherit the mask and live in the run's process group, so a Ctrl-C, `scancel` or
    `systemctl stop` then reaches the controller, which coordinates the stop, and not the processes the
    workers need to save the checkpoint. (Ray blocks SIGINT there itself; this adds SIGTERM.) Signals that
    arrive meanwhile are handled by another thread; a cluster started with `ray start` is not affected."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster and its total resources (``{"CPU": 8.0, "GPU": 8.0, ...}``)."""

    node_id: str
    ip: str
    resources: Mapping[str, float]

    def holds(self, bundle: Mapping[str, float]) -> int:
        """How many copies of `bundle` fit in this node's resources."""
        counts = [math.floor(self.resources.get(k, 0.0) / v + _EPS) for k, v in bundle.items() if v > 0]
        return min(counts) if counts else 0

    def __str__(self) -> str:
        shown = {k: v for k, v in self.resources.items() if k in ("CPU", "GPU") or _is_custom(k)}
        return f"{self.node_id[:8]} ({self.ip}: {_amounts(shown)})"


def _is_custom(key: str) -> bool:
    return not key.startswith("node:") and key not in ("CPU", "GPU", "memory", "object_store_memory")


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items())) or "nothing"


def alive_nodes(ray: Any) -> list[Node]:
    """The cluster's alive nodes with their total resources."""
    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"])) for n in ray.nodes() if n["Alive"]]


def pool_bundle(pool: ResourcePool) -> dict[str, float]:
    """What each of the pool's `nodes` shares reserves on its node: its slots' CPUs, one GPU per slot of a
    cuda pool, and a sliver of the pool's `node_resource` (which pins the share to nodes that have it)."""
    bundle = {"CPU": pool.cpus_per_process * pool.per_node}
    if pool.device == "cuda":
        bundle["GPU"] = float(pool.per_node)
    if pool.node_resource is not None:
        bundle[pool.node_resource] = PIN_AMOUNT
    return bundle


def _describe_pool(pool: ResourcePool) -> str:
    share = f"{pool.per_node} GPU" if pool.device == "cuda" else f"{pool.cpus_per_process * pool.per_node:g} CPU"
    where = f" on nodes with resource '{pool.node_resource}'" if pool.node_resource else ""
    if pool.nodes == 1:
        shape = f"{share} on one node{where}"
    else:
        shape = f"{pool.nodes} shares of {share}{where}, " + (
            "each on a node of its own (strategy spread)" if pool.strategy == "spread"
            else "on as few nodes as hold them (strategy pack)")
    return f"pool '{pool.name}' wants {shape}; a share reserves {_amounts(pool_bundle(pool))}"


def _pool_problem(pool: ResourcePool, nodes: list[Node], fix: str) -> str | None:
    bundle = pool_bundle(pool)
    fits = [node.holds(bundle) for node in nodes]
    hosts = sum(n > 0 for n in fits)
    room = hosts if pool.strategy == "spread" else sum(fits)
    if room >= pool.nodes:
        return None
    held = (f"{hosts} of the cluster's {len(nodes)} alive node(s) can hold a share"
            + (f" ({sum(fits)} share(s) in all)" if pool.strategy == "pack" and pool.nodes > 1 else ""))
    return f"{_describe_pool(pool)}; but {held}; nodes: {'; '.join(map(str, nodes)) or 'none'}; {fix}"


def check_capacity(pools: list[ResourcePool], nodes: list[Node], fixes: Mapping[str, str] | None = None) -> None:
    """Raises `CapacityError` when the cluster's alive `nodes` cannot hold the `pools` together.

    Checks each pool alone (enough nodes with room for its shares; for `spread` one share per node)
    and the pools together (their CPUs and GPUs against the cluster's totals). `fixes` maps a pool's name
    to the keys that size it, named in the message (default: the `ResourcePool` arguments)."""
    fixes = dict(fixes or {})
    default_fix = "change the pool's n_processes, nodes, strategy or node_resource, or add nodes"
    problems = [p for pool in pools if (p := _pool_problem(pool, nodes, fixes.get(pool.name, default_fix)))]
    for resource in ("GPU", "CPU"):
        wants = {pool.name: pool_bundle(pool).get(resource, 0.0) * pool.nodes for pool in pools}
        have = sum(node.resources.get(resource, 0.0) for node in nodes)
        if len(pools) > 1 and sum(wants.values()) > have + _EPS:
            split = ", ".join(f"{name} {n:g}" for name, n in wants.items() if n)
            keys = "; ".join(f"{name}: {fixes.get(name, default_fix)}" for name, n in wants.items() if n)
            problems.append(f"the pools want {sum(wants.values()):g} {resource} in all ({split}) but the cluster "
                            f"has {have:g} {resource} over {len(nodes)} alive node(s); {keys}")
    if problems:
        raise CapacityError("the Ray cluster cannot hold this run:\n  - " + "\n  - ".join(problems))


def unseen_on(ray: Any, path: str, node_ids: list[str]) -> list[str]:
    """The nodes among `node_ids` on which `path` does not exist (a tiny task pinned to each node asks)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    exists = ray.remote(num_cpus=0)(os.path.exists)
    refs = [exists.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(path)
            for node in node_ids]
    return [node for node, seen in zip(node_ids, ray.get(refs)) if not seen]
