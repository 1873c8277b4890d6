"""`hybridflow train` on a Ray cluster of simulated nodes on this machine (`ray.cluster_utils.Cluster`):
a head node (the controller's, 2 CPUs, custom resource `gen`) and two 1-CPU nodes with resource `train`.

A GRPO run whose actor spans the two `train` nodes and whose rollout group is packed onto `gen` gives the
local backend's metrics, with every rendezvous hosted by a rank-0 worker; a run the cluster cannot hold
is refused before any worker starts; nodes that cannot see a path are named; a node removed mid-run
stops the run within seconds naming role, rank and node, and `trainer.resume=auto` continues on a
replacement node. One cluster serves the module (each node takes seconds to start).
"""

from __future__ import annotations

import importlib.util
import threading
import time

import psutil
import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.config.resolved import resolve_facts
from hybridflow.controller import WorkerDiedError
from hybridflow.controller.cluster import connect, unseen_on
from hybridflow.trainer.rl import RLTrainer
from hybridflow.trainer.role_groups import build_roles
from rl_helpers import TWO_WORKERS, base_overrides, read_metrics, run
from test_rl_resume_and_backends import assert_same_metrics

pytestmark = [pytest.mark.ray, pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")]

ACTOR_ON_TWO_NODES = ("ray.actor.nnodes=2", "ray.actor.node_resource=train")


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray._common.utils import reset_ray_address
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a local instance an earlier test left connected
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(num_cpus=2, resources={"gen": 1}, include_dashboard=False))
    reset_ray_address()  # Cluster advertises itself to every `ray.init()` on the machine; keep it private
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"train": 1})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def on(cluster) -> tuple[str, ...]:
    return ("trainer.backend=ray", f"ray.address={cluster.address}")


def node_ids(cluster, resource: str) -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)}


def listens(pid: int, port: int) -> bool:
    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections())


def test_actor_over_two_nodes_and_a_pinned_rollout_give_the_local_metrics(cluster, tiny_qwen2, data_dir, tmp_path,
                                                                         local_two_workers):
    overrides = base_overrides(tiny_qwen2, data_dir, tmp_path, *TWO_WORKERS, *on(cluster),
                               *ACTOR_ON_TWO_NODES, "rollout.placement=separate", "ray.rollout.node_resource=gen",
                               "ray.rollout.nnodes=2", "ray.rollout.strategy=pack")  # one `gen` node holds both
    trainer = RLTrainer(load_config(overrides, "recipes/grpo.yaml"))
    actor, rollout = trainer.roles.groups
    spans, pinned = actor.placement(), rollout.placement()
    try:
        assert len(set(spans.nodes)) == 2 and set(spans.nodes) == node_ids(cluster, "train")
        assert len(pinned.nodes) == 2 and set(pinned.nodes) == node_ids(cluster, "gen")
        rank0 = actor.pids()[0]  # hosts both its group's store and the weight-sync group's, not the controller
        assert listens(rank0, spans.master[1]) and listens(rank0, trainer.roles.separate.address[1])
        assert trainer.roles.separate.address[0] == spans.ips[0]
        trainer.fit()
    finally:
        trainer.close()
    ray_rows = read_metrics(tmp_path)
    assert [r["step"] for r in ray_rows] == [1, 2]
    for a, b in zip(local_two_workers, ray_rows):
        assert_same_metrics(a, b)


def test_a_run_the_cluster_cannot_hold_is_refused_with_the_numbers(cluster, tiny_qwen2, data_dir, tmp_path):
    overrides = base_overrides(tiny_qwen2, data_dir, tmp_path, *on(cluster), "trainer.n_workers=4",
                               "ray.actor.nnodes=4", "ray.actor.node_resource=train")
    with pytest.raises(ConfigError) as refused:
        cfg = load_config(overrides, "recipes/grpo.yaml")
        build_roles(cfg, total_steps=1, facts=resolve_facts(cfg))
    assert ("pool 'actor' wants 4 shares of 1 CPU on nodes with resource 'train', each on a node of its own "
            "(strategy spread); a share reserves 1 CPU, 0.001 train; but 2 of the cluster's 3 alive node(s) can hold "
            "a share") in str(refused.value)
    assert "change trainer.n_workers, ray.actor.nnodes, ray.actor.strategy or ray.actor.node_resource" in str(
        refused.value)


def test_nodes_that_cannot_see_a_path_are_named(cluster, tmp_path):
    ids = sorted(node_ids(cluster, "CPU"))
    assert len(ids) == 3
    assert unseen_on(connect(), str(tmp_path), ids) == [] and unseen_on(connect(), str(tmp_path / "x"), ids) == ids


def test_a_node_removed_mid_run_is_named_and_resume_continues(cluster, tiny_qwen2, data_dir, tmp_path):
    args = ("trainer.val_before_train=false", "trainer.val_every=0", "trainer.n_workers=2", "trainer.total_steps=2",
            "trainer.save_every=1", *on(cluster), *ACTOR_ON_TWO_NODES)
    trainer = RLTrainer(load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, *args), "recipes/grpo.yaml"))
    victim_id, pids = trainer.roles.actor.placement().nodes[1], trainer.roles.actor.pids()
    victim = next(n for n in cluster.list_all_nodes() if n.node_id == victim_id)
    removed: list[float] = []

    def remove_after_first_checkpoint() -> None:
        while not (tmp_path / "checkpoints" / "step_00000001").is_dir():
            time.sleep(0.02)
        cluster.remove_node(victim)
        removed.append(time.monotonic())

    remover = threading.Thread(target=remove_after_first_checkpoint, daemon=True)
    remover.start()
    with pytest.raises(WorkerDiedError) as died:
        trainer.fit()
    raised = time.monotonic()
    remover.join(timeout=30)
    assert removed and raised - removed[0] < 10
    message = str(died.value) + "".join(died.value.__notes__)
    assert f"worker actor rank 1 died (pid {pids[1]} on node {victim_id[:8]}" in message
    assert "its node has died" in message
    assert "last complete checkpoint is" in message and "trainer.resume=auto" in message

    cluster.add_node(num_cpus=1, resources={"train": 1})  # the replacement
    rows = run(tiny_qwen2, data_dir, tmp_path, *args)
    assert [r["step"] for r in rows] == [1, 2]
