"""`RunnerHost`: the child process the agent runners run in (`runner_child`), seen from the rollout worker.

The worker's event loop (the one serving the endpoint) submits one job per trajectory and gets a future
of `(reward, metrics)`; a runner that raises fails its future with `RunnerFailed`. The child is started
on first use and kept between rollout phases; it is a process of its own (a new session, so it and what
it starts can be killed together), so a runner that exits, crashes or blocks its loop costs only its
trajectories: when the child dies every waiting future fails, and the next phase starts a new one.
`kill()` ends it (used when a runner outlived its time limit: a blocked child may not honour a cancel).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from multiprocessing.connection import Connection
from typing import Any

from hybridflow.utils.child_process import plain, spawn_module

STARTUP_TIMEOUT_S = 120.0


class RunnerFailed(Exception):
    """A runner raised, returned something else than a reward, or its process died."""


class RunnerHost:
    """The runner `spec` (`path/to/file.py:fn` or `package.module:fn`) called with `kwargs` in a child process."""

    def __init__(self, spec: str, kwargs: dict[str, Any]) -> None:
        self.spec, self.kwargs = spec, dict(kwargs)
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.jobs: dict[str, asyncio.Future] = {}
        self.ready: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def attach(self) -> None:
        """Start the child if it is not running, and listen to it on the running loop."""
        loop = self.loop = asyncio.get_running_loop()
        conn = self.conn  # set while the child runs
        if self.proc is None or self.proc.poll() is not None or conn is None:
            conn = self._spawn(loop)
        loop.add_reader(conn.fileno(), self._readable)
        if self.ready is not None:
            try:
                await asyncio.wait_for(self.ready, STARTUP_TIMEOUT_S)
            except asyncio.TimeoutError:
                self.kill()
                raise RuntimeError(f"the agent runner process did not start within {STARTUP_TIMEOUT_S:g} s "
                                   f"(agent.runner={self.spec!r})") from None
            finally:
                self.ready = None

    def detach(self) -> None:
        """Stop listening (the loop is ending); the child keeps running for the next phase."""
        if self.conn is not None and self.loop is not None:
            self.loop.remove_reader(self.conn.fileno())
        for future in self.jobs.values():
            future.cancel()
        self.jobs.clear()

    def submit(self, job: str, row: dict[str, Any], base_url: str, api_key: str) -> asyncio.Future:
        """Run the runner for one trajectory; a future of (reward, metrics), failed at once when the child is
        gone (it died since `attach`)."""
        if self.loop is None:
            raise RuntimeError("RunnerHost.submit() before attach(): there is no event loop to answer on")
        future = self.jobs[job] = self.loop.create_future()
        self._send(("run", job, plain(row), base_url, api_key))
        return future

    def cancel(self, job: str) -> None:
        self.jobs.pop(job, None)
        self._send(("cancel", job))

    def _send(self, message: tuple) -> None:
        """To the child; when it is gone (or the pipe breaks now) every waiting job fails (`_died`)."""
        if self.conn is not None:
            try:
                self.conn.send(message)
                return
            except OSError:
                pass
        self._died()

    def kill(self) -> None:
        """End the child and everything it started."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._died()

    def _spawn(self, loop: asyncio.AbstractEventLoop) -> Connection:
        self.proc, conn = spawn_module("hybridflow.agents.endpoint.runner_child")
        self.conn = conn
        self.ready = loop.create_future()
        conn.send(("init", self.spec, self.kwargs))
        return conn

    def _readable(self) -> None:
        try:
            while self.conn is not None and self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            self._died()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            if self.ready is not None and not self.ready.done():
                self.ready.set_result(None)
        elif kind == "init_error":
            if self.ready is not None and not self.ready.done():
                self.ready.set_exception(RuntimeError(f"agent.runner={self.spec!r} cannot be loaded: {message[1]}"))
        elif (future := self.jobs.pop(message[1], None)) is not None and not future.done():
            if kind == "done":
                future.set_result((message[2], message[3]))
            else:
                future.set_exception(RunnerFailed(message[2]))

    def _died(self) -> None:
        """The child is gone: every waiting job fails; the next `attach` starts a new one."""
        code = self.proc.poll() if self.proc is not None else None
        if self.conn is not None:
            if self.loop is not None:
                self.loop.remove_reader(self.conn.fileno())
            self.conn.close()
        self.conn, self.proc = None, None
        error = RunnerFailed(f"the agent runner process ended (exit code {code})")
        for future in [*self.jobs.values(), *([self.ready] if self.ready is not None else [])]:
            if not future.done():
                future.set_exception(error)
        self.jobs.clear()
