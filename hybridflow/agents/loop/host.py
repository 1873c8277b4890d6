"""`UserCodeHost`: a run's environments and tools in a process of their own (`host_process`), so that user
code that exits, hangs or crashes ends or stalls no more than the trajectories it served.

    host = UserCodeHost(host_setup(cfg.agent))  # starts the process: it loads the environment, builds the tools
    host.schemas                                # the tools' function schemas, for the prompts
    async with host.attached():                 # on the rollout's asyncio loop
        await host.call("open", tid, (row, env_kwargs))
        step = await host.call("step", tid, (text, turn))
        await host.call("close", tid)
    host.close()                                # kills it (also done when the object is collected or the run exits)

Requests made in one turn of the event loop go out as one message; replies come back in batches, so a call
costs a pipe round trip and no process start. `call` raises `UserCodeError` when the user code failed,
`TimeoutError` past `agent.timeout_s`, and `HostDied` when the process died (`os._exit`, a crash, the
kernel's OOM killer) or stopped answering (its event loop blocked past `timeout_s + HOST_GRACE_S`): it is
killed, its waiting requests fail, and so does every later request about a trajectory it held (that
trajectory's environment and tool state are gone); the next new trajectory starts a fresh process. When a
rollout ends (`attached` exits), a host that had a call time out is killed as well, taking the threads of
hung sync calls with it; the next rollout starts a fresh one.

`tool_schemas(agent_cfg)` starts a host only to check the environment file and the tools before any model
loads and to read the schemas the prompts show, so the controller never runs user code itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

from hybridflow.agents.loop.calls import UserCodeError
from hybridflow.agents.loop.host_process import HostSetup
from hybridflow.utils.child_process import plain, spawn_module
from hybridflow.utils.stop_signals import held_signals

logger = logging.getLogger(__name__)

HOST_GRACE_S = 10.0  # beyond agent.timeout_s, before a host that does not answer is given up
STARTUP_TIMEOUT_S = 300.0  # importing the environment file and building the tools
_WATCH_S = 1.0


class HostDied(Exception):
    """The environment / tool process died or stopped answering; the trajectories it held are lost."""



def host_setup(agent_cfg: Any) -> HostSetup:
    """The host's setup from the `agent` config section."""
    return HostSetup(agent_cfg.environment or None, plain(agent_cfg.tools or []), float(agent_cfg.timeout_s))


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill(process: subprocess.Popen, conn: Connection, scratch_root: str) -> None:
    conn.close()
    try:  # with whatever the user code started in its session
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (a stuck disk): leave it to the kernel, do not hang the run
        pass
    shutil.rmtree(scratch_root, ignore_errors=True)


class UserCodeHost:
    """The process running the environments and tools of `setup` (see the module docstring)."""

    def __init__(self, setup: HostSetup) -> None:
        self.setup = setup
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self._finalizer: weakref.finalize | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: dict[int, tuple[asyncio.Future, float]] = {}  # request id -> (reply, deadline)
        self.outbox: list[tuple] = []
        self.held: set[int] = set()  # trajectories opened on the current process
        self.lost: dict[int, str] = {}  # trajectory -> why its state is gone
        self.tainted = False  # a call timed out: its thread may still run
        self._ids = itertools.count()
        self.schemas: list[dict] = self._start()

    def _start(self) -> list[dict]:
        """Starts a process, hands it the setup, waits until it loaded the user code; returns the schemas."""
        root = tempfile.mkdtemp(prefix="hybridflow-host-")
        with held_signals():  # a stop between the start and the setup would leave the process without its work
            process, conn = spawn_module("hybridflow.agents.loop.host_process")
            finalizer = weakref.finalize(self, _kill, process, conn, root)
            conn.send(dataclasses.replace(self.setup, scratch_root=root))
        what = "the process running agent.environment / agent.tools"
        try:
            if not conn.poll(STARTUP_TIMEOUT_S):
                raise RuntimeError(f"{what} did not load them within {STARTUP_TIMEOUT_S:g} s")
            status, value = conn.recv()
        except (EOFError, OSError):
            finalizer()
            raise RuntimeError(f"{what} ended ({_exit_text(process.returncode)}) while loading them") from None
        except BaseException:
            finalizer()
            raise
        if status != "ready":
            finalizer()
            raise ValueError(value)
        self.process, self.conn, self._finalizer = process, conn, finalizer
        if self.loop is not None:
            self.loop.add_reader(conn.fileno(), self._readable)
        return value

    def _stop(self) -> None:
        if self.conn is not None and self.loop is not None:
            self.loop.remove_reader(self.conn.fileno())
        if self._finalizer is not None:
            self._finalizer()
        self.process = self.conn = self._finalizer = None
        self.tainted = False

    def close(self) -> None:
        """Kills the process (what it was running is dropped)."""
        self._stop()

    @contextlib.asynccontextmanager
    async def attached(self) -> AsyncIterator[UserCodeHost]:
        """Serves `call` on the running loop; at exit kills a host that had a call time out."""
        self.loop = asyncio.get_running_loop()
        if self.process is not None and self.process.poll() is not None:  # died between rollouts
            self._stop()
        if self.conn is not None:
            self.loop.add_reader(self.conn.fileno(), self._readable)
        watchdog = asyncio.create_task(self._watch())
        try:
            yield self
        finally:
            watchdog.cancel()
            if self.conn is not None:
                self.loop.remove_reader(self.conn.fileno())
            self.loop = None
            if self.tainted:
                self._stop()

    async def call(self, op: str, tid: int, payload: Any = None) -> Any:
        """Sends one request about trajectory `tid` and waits for its answer (see the module docstring)."""
        loop = self.loop
        if loop is None:
            raise RuntimeError("UserCodeHost.call() outside `async with host.attached()`: it answers on that loop")
        if tid in self.lost:
            raise HostDied(self.lost.pop(tid) if op == "close" else self.lost[tid])
        if self.conn is None:
            self._start()
        if op == "open":
            self.held.add(tid)
        rid = next(self._ids)
        future = loop.create_future()
        self.pending[rid] = (future, time.monotonic() + self.setup.timeout_s + HOST_GRACE_S)
        if not self.outbox:
            loop.call_soon(self._flush)
        self.outbox.append((rid, op, tid, payload))
        status, value = await future
        if op == "close":
            self.held.discard(tid)
        if status == "ok":
            return value
        if status == "timeout":
            self.tainted = True
            raise TimeoutError(value)
        raise UserCodeError(value)

    def _flush(self) -> None:
        batch, self.outbox = self.outbox, []
        if batch and self.conn is not None:
            try:
                self.conn.send(batch)
            except OSError:
                self._died(self._ended())

    def _readable(self) -> None:
        try:
            while self.conn is not None and self.conn.poll():
                for rid, result in self.conn.recv():
                    future, _ = self.pending.pop(rid, (None, 0.0))
                    if future is not None and not future.done():
                        future.set_result(result)
        except (EOFError, OSError):
            self._died(self._ended())

    def _ended(self) -> str:
        """Why the process is gone, once it has exited (its pipe closed or broke)."""
        code = self.process.wait() if self.process is not None else None
        return f"the environment / tool process ended ({_exit_text(code)})"

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            if self.pending and min(deadline for _, deadline in self.pending.values()) < time.monotonic():
                self._died(f"the environment / tool process stopped answering (no reply within "
                           f"{self.setup.timeout_s + HOST_GRACE_S:g} s)")

    def _died(self, reason: str) -> None:
        """Kills the process; its waiting requests fail, its trajectories are lost."""
        logger.warning("%s; the %d trajectories it held end with an error, a new process starts", reason,
                       len(self.held))
        self._stop()
        self.lost.update(dict.fromkeys(self.held, reason))
        self.held.clear()
        self.outbox.clear()
        for future, _ in self.pending.values():
            if not future.done():
                future.set_exception(HostDied(reason))
        self.pending.clear()


_SCHEMAS: dict[str, list[dict]] = {}


def tool_schemas(agent_cfg: Any) -> list[dict]:
    """The tools' function schemas for the prompts ([] without tools), read by a host started for the purpose,
    which also proves the environment and the tools load (ValueError naming the key otherwise). Without an
    environment and tools no process starts. Cached per setup in this process."""
    setup = host_setup(agent_cfg)
    if not setup.environment and not setup.tools:
        return []
    key = json.dumps(dataclasses.asdict(setup), sort_keys=True, default=repr)
    if key not in _SCHEMAS:
        host = UserCodeHost(setup)
        host.close()
        _SCHEMAS[key] = host.schemas
    return copy.deepcopy(_SCHEMAS[key])
