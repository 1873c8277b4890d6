"""Worker groups end to end, on the local and the Ray backend (2 CPU workers each)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import WorkerDiedError, WorkerError, WorkerGroup

from controller_workers import ToyWorker, alive, tiny_model


def rows(n: int) -> Batch:
    gen = torch.Generator().manual_seed(n)
    return Batch({"features": torch.randn(n, 4, generator=gen)}, {"uid": [f"row{i}" for i in range(n)]})


def test_worker_context(group):
    infos = group.actor.info()
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(i["world_size"] == 2 and i["dist_world"] == 2 and i["device"] == "cpu" for i in infos)
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert {i["role"] for i in infos} == {"actor"}
    assert {i["env"] for i in infos} == {"on"} and "HYBRIDFLOW_TEST_ENV" not in os.environ
    assert len({i["pid"] for i in infos} | {os.getpid()}) == 3
    assert group.world_size == 2
    assert group.pids() == [i["pid"] for i in infos]


def test_collectives_and_dispatch_modes(group):
    assert group.actor.allreduce_sum(1.5) == pytest.approx(1.5 * 1 + 1.5 * 2)
    assert group.actor.only_rank_zero() == 0
    assert group.actor.add_rank([1, 2], y=[10, 20]) == [11, 122]
    assert group.actor.row_count(rows(7), offset=1) == [5, 4]
    assert group.actor.total_rows(rows(7)) == {"rows": 7}  # collect="same": one result, not one per rank
    with pytest.raises(ValueError, match="must be a list of 2 values"):
        group.actor.add_rank([1])


@pytest.mark.parametrize("method", ["score", "score_padded"])
def test_seven_rows_round_trip_in_order(group, method):
    batch = rows(7)
    out = getattr(group.actor, method)(batch)
    with torch.no_grad():
        expected = tiny_model(4)(batch["features"]).squeeze(-1)
    assert len(out) == 7
    assert list(out["uid"]) == list(batch["uid"])
    torch.testing.assert_close(out["score"], expected, rtol=0, atol=0)
    assert out["rank"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert out.meta["total_rows"] == (8 if method == "score_padded" else 7)


def test_submit_returns_future(group):
    future = group.actor.allreduce_sum.submit(2.0)
    assert future.result(timeout=60) == pytest.approx(6.0)


def test_worker_exception_has_role_rank_and_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.actor.fail_on(1, "bad row 17")
    err = info.value
    assert (err.role, err.rank) == ("policy", 1)
    assert "(policy rank 1) actor.fail_on failed: ValueError: bad row 17" in str(err)
    assert "controller_workers.py" in str(err) and "raise ValueError(message)" in str(err)
    assert group.actor.allreduce_sum(1.0) == pytest.approx(3.0)  # the group keeps working


def test_worker_output_is_forwarded_with_prefix_before_the_call_returns(group, capfd):
    assert group.actor.shout("hello-from-worker")
    out, err = capfd.readouterr()  # a call's output is printed before its result is handed back
    for r in (0, 1):
        assert f"(policy rank {r}) hello-from-worker (out)\n" in out
        assert f"(policy rank {r}) hello-from-worker (err)\n" in err
    assert "hybridflow-sync" not in out + err


def test_argument_that_cannot_travel_fails_before_any_rank_starts(group):
    bad = rows(7)
    bad["fn"] = [0, 1, 2, 3, 4, 5, lambda: None]  # only rank 1's shard holds the unpicklable row
    with pytest.raises(Exception, match="pickle"):
        group.actor.score(bad)
    # had rank 0 started `score` alone, it would now sit in score's all_reduce
    assert group.actor.allreduce_sum.submit(1.0).result(timeout=60) == pytest.approx(3.0)


def test_undecorated_method_is_not_callable(group):
    with pytest.raises(AttributeError, match=r"ToyWorker.helper is not callable from the controller.*allreduce_sum"):
        group.actor.helper
    with pytest.raises(AttributeError, match="has no method 'nope'"):
        group.actor.nope


def test_colocated_members_share_the_process(group):
    where = group.ref.where()
    infos = group.actor.info()
    assert [w[0] for w in where] == ["ref", "ref"] and [w[1] for w in where] == [0, 1]
    assert [w[3] for w in where] == [i["pid"] for i in infos]
    batch = rows(5)
    ref = group.ref.log_probs(batch)
    torch.testing.assert_close(ref["ref"], batch["features"].sum(-1) * 2.0)
    with pytest.raises(AttributeError, match="colocated members: actor, ref"):
        group.log_probs


def test_second_group_overlaps_then_detects_a_killed_worker(backend, cpu_pool, group, tmp_path):
    victim = WorkerGroup(ToyWorker, 2, backend=backend, pool=cpu_pool, name="victim")
    try:
        # each call waits until the other group's call has started: they can only finish together
        first = group.actor.rendezvous.submit(str(tmp_path), "policy", "victim")
        second = victim.rendezvous.submit(str(tmp_path), "victim", "policy")
        assert second.result(timeout=90) == "victim" and first.result(timeout=90) == "policy"

        pids, nodes = victim.pids(), victim.placement().nodes
        pending = victim.block.submit(120)
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"worker victim rank 1 died \(pid {pids[1]}") as info:
            pending.result(timeout=30)
        assert time.monotonic() - started < 15
        if backend == "local":
            assert "SIGKILL" in str(info.value) and nodes == ["local", "local"]
        else:  # the error names the Ray node the worker ran on
            assert f"died (pid {pids[1]} on node {nodes[1][:8]} (" in str(info.value)
        with pytest.raises(WorkerDiedError):
            victim.allreduce_sum(1.0)
        assert group.actor.allreduce_sum(1.0) == pytest.approx(3.0)  # other groups are unaffected
    finally:
        victim.shutdown()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "worker processes outlived shutdown()"
