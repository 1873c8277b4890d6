"""Controller pieces without worker processes: dispatch, register, pools, colocate, inline groups."""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerError, WorkerGroup, colocate, register
from hybridflow.controller.dispatch import gather, registered_methods, scatter

from controller_workers import RefWorker, ToyWorker, tiny_model


def numbered(n: int) -> Batch:
    return Batch({"x": torch.arange(n)}, {"uid": [f"u{i}" for i in range(n)]})


@pytest.mark.parametrize("world, sizes", [(2, [4, 3]), (3, [3, 2, 2]), (8, [1] * 7 + [0])])
def test_data_parallel_scatter_is_uneven_and_ordered(world, sizes):
    spec = registered_methods(ToyWorker)["score"]
    batch = numbered(7)
    scattered = scatter(spec, "score", (batch,), {}, world)
    pieces = [call[1][0] for call in scattered.calls]
    assert [len(p) for p in pieces] == sizes
    assert gather(spec, "score", scattered, pieces) == batch


@pytest.mark.parametrize("world", [2, 3, 4])
def test_data_parallel_pad_strips_padding(world):
    spec = registered_methods(ToyWorker)["score_padded"]
    batch = numbered(7)
    scattered = scatter(spec, "score_padded", (), {"batch": batch}, world)
    pieces = [call[2]["batch"] for call in scattered.calls]
    assert len({len(p) for p in pieces}) == 1 and sum(len(p) for p in pieces) == 7 + scattered.n_pad
    assert gather(spec, "score_padded", scattered, pieces) == batch
    with pytest.raises(ValueError, match="padding can only be stripped"):
        gather(spec, "score_padded", scattered, [p[:1] for p in pieces])


def test_data_parallel_broadcasts_other_args_and_lists_other_results():
    spec = registered_methods(ToyWorker)["row_count"]
    scattered = scatter(spec, "row_count", (numbered(5),), {"offset": 3}, 2)
    assert [call[2] for call in scattered.calls] == [{"offset": 3}, {"offset": 3}]
    assert gather(spec, "row_count", scattered, [3, 2]) == [3, 2]
    with pytest.raises(TypeError, match="got no Batch argument"):
        scatter(spec, "row_count", (5,), {}, 2)
    with pytest.raises(ValueError, match="equal lengths"):
        scatter(spec, "row_count", (numbered(5), numbered(4)), {}, 2)


def test_other_dispatch_modes():
    specs = registered_methods(ToyWorker)
    bcast = scatter(specs["allreduce_sum"], "allreduce_sum", (1.0,), {}, 3)
    assert [c[0] for c in bcast.calls] == [0, 1, 2] and all(c[1] == (1.0,) for c in bcast.calls)
    assert gather(specs["allreduce_sum"], "allreduce_sum", bcast, [5, 6, 7]) == 5
    assert gather(specs["info"], "info", bcast, [5, 6, 7]) == [5, 6, 7]
    zero = scatter(specs["only_rank_zero"], "only_rank_zero", (), {}, 3)
    assert [c[0] for c in zero.calls] == [0]
    per = scatter(specs["add_rank"], "add_rank", ([1, 2, 3],), {"y": (4, 5, 6)}, 3)
    assert [(c[1], c[2]) for c in per.calls] == [((1,), {"y": 4}), ((2,), {"y": 5}), ((3,), {"y": 6})]
    with pytest.raises(ValueError, match="argument 0 must be a list of 3 values.*got int"):
        scatter(specs["add_rank"], "add_rank", (1,), {}, 3)


def test_collect_same_returns_the_one_result_or_names_where_ranks_disagree():
    spec = registered_methods(ToyWorker)["total_rows"]
    scattered = scatter(spec, "total_rows", (numbered(5),), {}, 3)
    nan = float("nan")
    agreed = gather(spec, "total_rows", scattered, [{"loss": 1.5, "norm": nan}] * 3)
    assert agreed["loss"] == 1.5 and math.isnan(agreed["norm"])  # NaN on every rank is agreement
    assert gather(spec, "total_rows", scattered, [torch.tensor([1.0, nan])] * 3).shape == (2,)
    with pytest.raises(ValueError, match=r"total_rows is registered with collect='same' but rank 2's result "
                                         r"differs from rank 0's \(loss: 1.5 vs 2.5; lr: 0.1 vs '<absent>'\)"):
        gather(spec, "total_rows", scattered, [{"loss": 1.5, "lr": 0.1}] * 2 + [{"loss": 2.5}])


def test_register_validates_its_options():
    with pytest.raises(ValueError, match="collect='all' exists only for Dispatch.BROADCAST"):
        register(Dispatch.DATA_PARALLEL, collect="all")
    with pytest.raises(ValueError, match="collect='same' for every mode that runs on all ranks"):
        register(Dispatch.RANK_ZERO, collect="same")
    with pytest.raises(ValueError, match="collect='any' is not valid; valid: 'default', 'all', 'same'"):
        register(Dispatch.BROADCAST, collect="any")
    with pytest.raises(ValueError, match="pad=True is only valid with Dispatch.DATA_PARALLEL"):
        register(Dispatch.BROADCAST, pad=True)
    with pytest.raises(TypeError, match="with parentheses"):
        register(lambda self: None)


def test_registered_methods_follow_inheritance():
    class Child(ToyWorker):
        def score(self, batch):  # an undecorated override keeps the parent's dispatch
            return batch

    methods = registered_methods(Child)
    assert methods["score"].mode is Dispatch.DATA_PARALLEL
    assert "helper" not in methods and "get_pid" in methods


def test_pool_refuses_oversubscription():
    pool = ResourcePool(2, name="small")
    with pytest.raises(ValueError, match=r"group 'big' asks for 3 processes but ResourcePool 'small'.*n_workers <= 2"):
        WorkerGroup(ToyWorker, 3, pool=pool, name="big")
    assert pool.groups == []
    with pytest.raises(ValueError, match="cannot be spread evenly over nodes=2"):
        ResourcePool(3, nodes=2)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        ResourcePool(1, "tpu")
    with pytest.raises(ValueError, match="use nodes=1 or backend='ray'"):
        ResourcePool(2, nodes=2).attach("actor", 2, "local")


def test_gpu_pool_holds_one_group_and_checks_devices():
    pool = ResourcePool(2, "cuda", name="gpus")
    pool.attach("actor", 2, "ray")  # Ray places GPUs itself: no local device check
    with pytest.raises(ValueError, match=r"cannot join ResourcePool 'gpus'.*held by group\(s\) \['actor'\].*colocate"):
        pool.attach("critic", 2, "ray")
    pool.detach("actor")
    pool.attach("critic", 2, "ray")
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=rf"needs {too_many} GPU\(s\) but this machine has {too_many - 1}"):
        WorkerGroup(ToyWorker, too_many, device="cuda", name="greedy")
    with pytest.raises(ValueError, match="wants device 'cuda'"):
        WorkerGroup(ToyWorker, 1, device="cuda", pool=ResourcePool(1, "cpu"))


def test_colocate_validation_and_pickling():
    cls = colocate(actor=ToyWorker, ref=RefWorker)
    assert pickle.loads(pickle.dumps(cls)).members == {"actor": ToyWorker, "ref": RefWorker}
    with pytest.raises(TypeError, match="must be a Worker subclass"):
        colocate(actor=int)
    with pytest.raises(ValueError, match="at least one member"):
        colocate()
    with pytest.raises(ValueError, match="clash with WorkerGroup attributes"):
        WorkerGroup(colocate(pool=ToyWorker), 1)


def test_ray_backend_error_without_ray(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r"backend='ray' needs the ray package"):
        WorkerGroup(ToyWorker, 1, backend="ray", name="noray")


class Recorder(Worker):
    def __init__(self) -> None:
        self.seen: list[str] = []

    @register(Dispatch.DATA_PARALLEL)
    def consume(self, batch: Batch) -> Batch:
        batch.pop("x")
        self.seen.append(",".join(batch["uid"]))
        return batch

    @register(Dispatch.BROADCAST)
    def state(self) -> tuple:
        return (os.getpid(), self.rank, self.world_size, str(self.device), dist.get_world_size(), self.seen)

    @register(Dispatch.BROADCAST)
    def crash(self) -> None:
        raise KeyError("missing thing")


def test_inline_group_runs_in_the_controller():
    first = WorkerGroup(Recorder, 1, name="inline-a")
    second = WorkerGroup(ToyWorker, 1, name="inline-b")
    try:
        batch = numbered(3)
        out = first.consume(batch)
        assert "x" in batch and out.keys() == ["uid"]  # the caller's batch is untouched
        assert first.consume.submit(numbered(2)).result(timeout=10).keys() == ["uid"]
        assert first.state() == (os.getpid(), 0, 1, "cpu", 1, ["u0,u1,u2", "u0,u1"])
        assert second.allreduce_sum(2.0) == 2.0  # both share the one world-size-1 process group
        with torch.no_grad():
            expected = tiny_model(4)(torch.ones(2, 4)).squeeze(-1)
        got = second.score(Batch({"features": torch.ones(2, 4)}, {"uid": ["a", "b"]}))
        torch.testing.assert_close(got["score"], expected)
        with pytest.raises(WorkerError, match=r"\(inline-a rank 0\) crash failed: KeyError: 'missing thing'") as info:
            first.crash()
        assert isinstance(info.value.__cause__, KeyError) or "raise KeyError" in str(info.value)
    finally:
        first.shutdown()
        second.shutdown()
    with pytest.raises(RuntimeError, match="is shut down"):
        first.state()



def test_inline_group_output_has_the_process_groups_prefix(capsys):
    group = WorkerGroup(ToyWorker, 1, name="solo")  # one worker: inline, in this process
    try:
        print("controller line")
        assert group.shout("hello")
        assert group.shout.submit("from a thread").result(timeout=60)  # submits run in a helper thread
    finally:
        group.shutdown()
    print("controller again", end="")
    out, err = capsys.readouterr()
    assert out == ("(solo rank 0) toy ready rank 0\ncontroller line\n(solo rank 0) hello (out)\n"
                   "(solo rank 0) from a thread (out)\ncontroller again")
    assert err == "(solo rank 0) hello (err)\n(solo rank 0) from a thread (err)\n"


def test_log_server_prefixes_lines_and_tracks_sync_marks(capsys):
    import json
    import socket

    from hybridflow.controller.logs import _SYNC, LogServer

    server = LogServer()
    conns = []
    for stream in ("stdout", "stderr"):
        conn = socket.create_connection(server.address)
        conn.sendall(json.dumps({"prefix": "(critic rank 3) ", "stream": stream, "key": "w3"}).encode() + b"\n")
        conns.append(conn)
    conns[0].sendall(b"step 1\n\nno newline yet" + f"{_SYNC}7\n".encode())
    assert not server.wait_synced("w3", 7, timeout=0.2)  # stderr has not reached call 7 yet
    conns[1].sendall(f"warning\n{_SYNC}7\n".encode())
    assert server.wait_synced("w3", 7, timeout=10)
    out, err = capsys.readouterr()
    assert out == "(critic rank 3) step 1\n(critic rank 3) \n(critic rank 3) no newline yet\n"
    assert err == "(critic rank 3) warning\n"
    for conn in conns:
        conn.close()


def test_a_peer_death_is_reported_rather_than_the_collective_error_it_caused(monkeypatch):
    from concurrent.futures import Future

    from hybridflow.controller import WorkerDiedError
    from hybridflow.controller import group as group_module

    monkeypatch.setattr(group_module, "CAUSE_GRACE_S", 0.3)
    broken, dead = WorkerError("actor", 0, "update", "RuntimeError: Connection reset by peer"), \
        WorkerDiedError("actor", 1, "pid 7 on node abcd1234 (10.0.0.2), its Ray actor died")

    parts = [Future(), Future()]
    combined = group_module._combine(parts, list)
    parts[0].set_exception(broken)  # rank 0's collective broke first ...
    assert not combined.done()
    parts[1].set_exception(dead)  # ... because rank 1 died
    assert combined.exception() is dead

    parts = [Future(), Future()]
    combined = group_module._combine(parts, list)
    parts[0].set_exception(broken)  # rank 1 stays stuck: the error comes after the grace period
    assert combined.exception(timeout=5) is broken

    parts = [Future(), Future()]
    combined = group_module._combine(parts, list)
    parts[1].set_result(2)
    parts[0].set_exception(broken)  # every rank is done: no wait
    assert combined.done() and combined.exception() is broken


def test_submit_starts_a_remote_method_and_refuses_anything_else():
    from hybridflow.controller import submit

    class Method:
        """Stands for a group's `RemoteMethod` (what `submit` accepts is checked by type)."""

    with pytest.raises(TypeError, match="takes a method of a WorkerGroup or MemberView"):
        submit(Method(), 1)


def test_per_rank_types_a_method_that_returns_one_result_per_rank_and_refuses_the_others():
    from hybridflow.controller import per_rank, submit

    group = WorkerGroup(ToyWorker, 1, name="per-rank")
    try:
        assert [r["rank"] for r in per_rank(group.info)()] == [0]  # collect="all": a list
        assert submit(per_rank(group.row_count), numbered(3), offset=1).result(timeout=10) == [4]
        for one_result in (group.allreduce_sum, group.total_rows, group.only_rank_zero):
            with pytest.raises(TypeError, match="collects one result"):
                per_rank(one_result)
        with pytest.raises(TypeError, match="takes a method of a WorkerGroup or MemberView"):
            per_rank(len)
    finally:
        group.shutdown()
