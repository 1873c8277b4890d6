"""How the local backend starts a CPU group's processes: forked from a fork server that was started before, they
still get the controller's environment as it is when the group starts (not the server's), and its import path."""

from __future__ import annotations

import os

import pytest

from hybridflow.controller import WorkerGroup
from hybridflow.controller.backends.process_start import fork_server_context

from controller_workers import ToyWorker

LATE_WORKER = '''
import os
from hybridflow.controller import Dispatch, Worker, register


class LateWorker(Worker):
    @register(Dispatch.BROADCAST, collect="all")
    def where(self):
        return __file__, os.getpid()
'''


def test_a_variable_set_after_the_server_started_reaches_the_workers_and_one_removed_does_not(monkeypatch):
    fork_server_context()  # the server runs, with the environment of before
    monkeypatch.setenv("HYBRIDFLOW_TEST_ENV", "set just now")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the server itself has it, empty
    group = WorkerGroup(ToyWorker, 2, inline=False, name="late-env", env={"HYBRIDFLOW_TEST_GROUP": "group"})
    try:
        for env, parent in group.environment():
            assert parent != os.getpid()  # forked from the server, not from this process
            assert env["HYBRIDFLOW_TEST_ENV"] == "set just now" and env["HYBRIDFLOW_TEST_GROUP"] == "group"
            assert "CUDA_VISIBLE_DEVICES" not in env
            assert {k: env.get(k) for k in os.environ} == dict(os.environ)
    finally:
        group.shutdown()


def test_a_worker_class_on_a_path_added_after_the_server_started_is_found(tmp_path, monkeypatch):
    fork_server_context()
    (tmp_path / "late_added_workers.py").write_text(LATE_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    from late_added_workers import LateWorker

    group = WorkerGroup(LateWorker, 2, inline=False, name="late-path")
    try:
        places = group.where()
        assert {f for f, _ in places} == {str(tmp_path / "late_added_workers.py")}
        assert len({pid for _, pid in places} | {os.getpid()}) == 3
    finally:
        group.shutdown()


def test_stopping_the_fork_server_ends_it_at_once_and_a_later_group_starts_another():
    """A run stopped by a signal ends the fork server before its last line (`cli._stopped`), even one still importing
    its preload; the next CPU group starts a new one."""
    from multiprocessing import forkserver

    from hybridflow.controller.backends.process_start import stop_fork_server

    fork_server_context()
    pid = forkserver._forkserver._forkserver_pid
    stop_fork_server()
    assert forkserver._forkserver._forkserver_pid is None
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)
    stop_fork_server()  # none runs: nothing to do
    group = WorkerGroup(ToyWorker, 2, inline=False, name="after-stop")
    try:
        assert all(parent != os.getpid() for _, parent in group.environment())
        assert forkserver._forkserver._forkserver_pid not in (None, pid)
    finally:
        group.shutdown()
