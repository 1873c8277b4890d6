"""`check_capacity`: pools a Ray cluster cannot hold are refused with the numbers and the keys to change
(the cluster is described by hand, so no Ray is needed)."""

from __future__ import annotations

import pytest

from hybridflow.controller import ResourcePool
from hybridflow.controller.cluster import CapacityError, Node, check_capacity, pool_bundle

EIGHT_GPUS = [Node(f"node{i:04d}", f"10.0.0.{i}", {"CPU": 64.0, "GPU": 8.0}) for i in (1, 2)]


def refusal(pools, nodes, fixes=None) -> str:
    with pytest.raises(CapacityError) as refused:
        check_capacity(pools, nodes, fixes)
    return str(refused.value)


def test_gpus_in_all_and_per_node():
    actor, rollout = ResourcePool(16, "cuda", nodes=2, name="actor"), ResourcePool(8, "cuda", name="rollout")
    check_capacity([actor], EIGHT_GPUS)
    message = refusal([actor, rollout], EIGHT_GPUS, {"rollout": "lower rollout.n_workers"})
    assert ("the pools want 24 GPU in all (actor 16, rollout 8) but the cluster has 16 GPU over 2 alive node(s); "
            "actor: change the pool's n_processes, nodes, strategy or node_resource, or add nodes; rollout: lower "
            "rollout.n_workers") in message
    assert ("pool 'actor' wants 16 GPU on one node; a share reserves 16 CPU, 16 GPU; but 0 of the cluster's 2 "
            "alive node(s) can hold a share; nodes: node0001 (10.0.0.1: 64 CPU, 8 GPU); node0002 (10.0.0.2: 64 CPU, "
            "8 GPU); raise ray.actor.nnodes") in refusal([ResourcePool(16, "cuda", name="actor")], EIGHT_GPUS,
                                                     {"actor": "raise ray.actor.nnodes"})


def test_spread_needs_a_node_per_share_and_pack_lets_shares_share_one():
    one = EIGHT_GPUS[:1]
    check_capacity([ResourcePool(8, "cuda", nodes=2, strategy="pack")], one)
    spread = ResourcePool(8, "cuda", nodes=2, strategy="spread", name="pool")
    assert ("pool 'pool' wants 2 shares of 4 GPU, each on a node of its own (strategy spread); a share reserves "
            "4 CPU, 4 GPU; but 1 of the cluster's 1 alive node(s) can hold a share") in refusal([spread], one)
    assert ("(strategy pack); a share reserves 4 CPU, 4 GPU; but 1 of the cluster's 1 alive node(s) can hold a share "
            "(2 share(s) in all)") in refusal([ResourcePool(12, "cuda", nodes=3, strategy="pack")], one)


def test_node_resource_pins_a_pool_to_the_nodes_that_have_it():
    nodes = [*EIGHT_GPUS, Node("node0003", "10.0.0.3", {"CPU": 8.0, "GPU": 8.0, "rollout": 1.0})]
    pinned = ResourcePool(8, "cuda", name="rollout", node_resource="rollout")
    assert pool_bundle(pinned) == {"CPU": 8.0, "GPU": 8.0, "rollout": 0.001}
    check_capacity([pinned], nodes)
    two = ResourcePool(16, "cuda", nodes=2, node_resource="rollout")
    assert "2 shares of 8 GPU on nodes with resource 'rollout', each on a node of its own" in refusal([two], nodes)


def test_cpu_pools_reserve_their_cpus():
    nodes = [Node("head", "10.0.0.1", {"CPU": 2.0})]
    check_capacity([ResourcePool(2, name="a")], nodes)
    assert "the pools want 4 CPU in all (a 2, b 2) but the cluster has 2 CPU" in refusal(
        [ResourcePool(2, name="a"), ResourcePool(2, name="b")], nodes)


def test_pool_options_are_checked():
    with pytest.raises(ValueError, match=r"strategy must be one of \('spread', 'pack'\), got 'scatter'"):
        ResourcePool(2, strategy="scatter")
    with pytest.raises(ValueError, match="node_resource=.x. picks Ray nodes; the local backend"):
        ResourcePool(2, node_resource="x").attach("actor", 2, "local")
