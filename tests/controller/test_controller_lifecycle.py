"""No orphan workers: a controller that exits without shutdown() (atexit) or is SIGKILLed (the
workers' watchdog) leaves no worker process behind, nor the fork server they came from. Local backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.controller import ResourcePool, WorkerError, WorkerGroup

from controller_workers import BrokenInit, alive

CONTROLLER = """
import sys, time
from hybridflow.controller import WorkerGroup
from hybridflow.controller.backends import process_start
from controller_workers import ToyWorker

process_start.PRELOAD.append("hybridflow_no_such_module")  # multiprocessing skips it: the server still starts
group = WorkerGroup(ToyWorker, 1, inline=False, name="orphan")
print("PIDS", *group.pids(), flush=True)
if sys.argv[1] == "hang":
    time.sleep(600)
"""


def _start(mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    return subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, mode], stdout=subprocess.PIPE, text=True, env=env
    )


def _worker_pids(proc: subprocess.Popen) -> list[int]:
    for line in proc.stdout:
        if line.startswith("PIDS"):
            return [int(p) for p in line.split()[1:]]
    raise AssertionError(f"controller ended (rc={proc.wait()}) before reporting its workers")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(") ")[1].split()[1])


def _wait_gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_controller_exit_and_death_leave_no_orphans():
    exiting, hanging = _start("exit"), _start("hang")
    try:
        exit_pids, hang_pids = _worker_pids(exiting), _worker_pids(hanging)
        assert exiting.wait(timeout=60) == 0
        assert _wait_gone(exit_pids, 10), "atexit did not stop the workers"
        assert all(alive(p) for p in hang_pids)
        server = _parent(hang_pids[0])
        assert server != hanging.pid and _parent(server) == hanging.pid  # forked from the controller's fork server
        hanging.send_signal(signal.SIGKILL)
        hanging.wait(timeout=10)
        assert _wait_gone(hang_pids, 10), "workers outlived their SIGKILLed controller"
        assert _wait_gone([server], 10), "the fork server outlived its SIGKILLed controller"
    finally:
        for proc in (exiting, hanging):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_failing_init_raises_at_start_and_frees_the_pool():
    pool = ResourcePool(2, name="init-pool")
    with pytest.raises(WorkerError, match=r"\(broken rank 1\) __init__ failed: RuntimeError: cannot load weights") as info:
        WorkerGroup(BrokenInit, 2, pool=pool, name="broken")
    assert "controller_workers.py" in str(info.value)
    assert pool.groups == []


def test_a_stop_signal_between_two_worker_starts_leaves_no_process(monkeypatch):
    """A SIGTERM that arrives while the first of two workers starts is delivered when its `held_signals` block ends,
    before the second starts: the group's start raises it, and the worker already started is shut down at once.
    Left alive (it was, unrecorded), it waited forever for its work, and the interpreter's exit, which joins its
    multiprocessing children, with it: `hybridflow train` hung instead of stopping."""
    from controller_workers import ToyWorker

    from hybridflow.controller.backends import local
    from hybridflow.utils.stop_signals import Interrupted

    started = []
    spawn = local.LocalBackend._spawn

    def spawn_then_signal(self, ctx, rank, env):
        ready = spawn(self, ctx, rank, env)
        started.append(self.procs[rank])
        if rank == 0:
            raise Interrupted(signal.SIGTERM, second=False)  # as held_signals delivers it
        return ready

    monkeypatch.setattr(local.LocalBackend, "_spawn", spawn_then_signal)
    begun = time.monotonic()
    with pytest.raises(Interrupted):
        WorkerGroup(ToyWorker, 2, inline=False, name="interrupted")
    assert len(started) == 1 and not started[0].is_alive()
    assert time.monotonic() - begun < 30
