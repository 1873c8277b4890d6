"""The process where a run's environments and tools live (`hybridflow.agents.loop.host` starts it and talks to it).

    python -m hybridflow.agents.loop.host_process FD PARENT_PID   # `spawn_module` starts it; FD: its end of the pipe

It dies with its parent, ignores SIGINT and SIGTERM (the run decides how it stops), and caps what user code
prints per call. It reads a `HostSetup`, loads the environment class and builds the tools (user code:
their modules run here, never in the controller), and answers `("ready", tool schemas)` or
`("failed", message)`. Then it serves batches of requests `(request id, op, trajectory id, payload)`,
each in a task of its own on one asyncio loop, and sends back batches of `(request id, (status, value))`:

- `open`, payload (row, `agent.env_kwargs`): the trajectory's tool contexts are made, then its environment
  (if that fails: an error, and no environment); value None;
- `step`, payload (text, turn): the environment's `EnvStep`;
- `tool`, payload a `ToolCall`: its `ToolResult` (a failing tool gives an error result, not an error status);
- `close`, no payload: the tools' end-of-trajectory rewards (`ToolSet.finish`), after which the
  environment's `close()` has run (a failure is logged here) and the scratch directory is gone. After a
  `step` of the trajectory timed out, its `close()` is started but not waited on: a sync step still holds its
  thread (and maybe what close needs), so waiting would cost another `timeout_s` and a warning that blames
  close for the step; the host is killed at the end of the rollout anyway, as one with a timed-out call.

status is `ok`, `error` (the message) or `timeout` (the call is past `timeout_s`; a sync call may still be
running in its thread, which is why the parent kills a host that timed out at the end of the rollout).
Sync user code runs in a pool of `ENV_THREADS` threads, async code on the loop. When the parent closes
its end, the process exits at once, whatever its threads are doing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from hybridflow.agents.loop.calls import UserCodeError, call_with_timeout
from hybridflow.agents.loop.environment import as_env_step, environment_kwargs, load_environment
from hybridflow.agents.tools.tool import Scratch, ToolContext
from hybridflow.agents.tools.toolset import ToolSet
from hybridflow.utils.child_process import cap_prints, parent_connection
from hybridflow.utils.stop_signals import ignore_stop_signals

logger = logging.getLogger(__name__)

ENV_THREADS = 32  # sync environment steps and tool calls in flight at once


@dataclass(frozen=True)
class HostSetup:
    """environment: `agent.environment` (or None); tools: `agent.tools` as plain lists and dicts; timeout_s:
    `agent.timeout_s`; scratch_root: where trajectories' scratch directories are made."""

    environment: str | None
    tools: list = field(default_factory=list)
    timeout_s: float = 30.0
    scratch_root: str | None = None


def _describe(error: BaseException) -> str:
    """The message of an error loading user code; its type too when the message alone says little."""
    return str(error) if isinstance(error, Exception) and str(error) else f"{type(error).__name__}: {error}"


@dataclass
class _Episode:
    scratch: Scratch
    contexts: dict[str, ToolContext]
    env: Any = None
    step_timed_out: bool = False


class HostState:
    """The environment class, the tools and the open trajectories' objects; `handle` answers one request."""

    def __init__(self, setup: HostSetup) -> None:
        self.setup = setup
        self.env_class = None
        if setup.environment:
            try:
                self.env_class = load_environment(setup.environment)
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which refuses the run
                raise ValueError(f"agent.environment={setup.environment!r}: {_describe(e)}") from None
        try:
            self.tools = ToolSet(setup.tools)
            self.schemas = self.tools.schemas()
        except BaseException as e:  # noqa: BLE001
            raise ValueError(f"agent.tools: {_describe(e)}") from None
        self.threads = ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="hybridflow-env")
        self.episodes: dict[int, _Episode] = {}
        self.unawaited: set[asyncio.Future] = set()  # closes started after a timed-out step (a reference each)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await call_with_timeout(fn, *args, timeout_s=self.setup.timeout_s, threads=self.threads)

    async def handle(self, op: str, tid: int, payload: Any) -> tuple[str, Any]:
        try:
            return "ok", await getattr(self, f"_{op}")(tid, payload)
        except TimeoutError as e:
            return "timeout", str(e)
        except Exception as e:  # noqa: BLE001 - UserCodeError, or a bad return value (TypeError)
            return "error", str(e) if isinstance(e, UserCodeError) else f"{type(e).__name__}: {e}"

    async def _open(self, tid: int, payload: tuple[dict, dict]) -> None:
        row, env_kwargs = payload
        scratch = Scratch(self.setup.scratch_root)
        episode = self.episodes[tid] = _Episode(scratch, self.tools.contexts(row, scratch))
        if self.env_class is not None:
            kwargs = environment_kwargs(self.env_class, env_kwargs, row)
            episode.env = await self._call(functools.partial(self.env_class, dict(row), **kwargs))

    async def _step(self, tid: int, payload: tuple[str, int]) -> Any:
        episode = self.episodes[tid]
        try:
            answer = await self._call(episode.env.step, *payload)
        except TimeoutError:
            episode.step_timed_out = True
            raise
        return as_env_step(answer, f"{self.setup.environment} step()")

    async def _tool(self, tid: int, call: Any) -> Any:
        context = self.episodes[tid].contexts.get(call.name)
        return await self.tools.run(call, context, self.setup.timeout_s, self.threads)

    def _forget(self, closing: asyncio.Future) -> None:
        """A close started after its step timed out has ended: its outcome is read (whatever it raised, or its own
        timeout, stems from the hung step already reported) and the reference dropped."""
        self.unawaited.discard(closing)
        if not closing.cancelled():
            closing.exception()

    async def _close(self, tid: int, payload: None) -> float:
        episode = self.episodes.pop(tid, None)
        if episode is None:
            return 0.0
        try:
            reward = await self.tools.finish(episode.contexts, self.setup.timeout_s, self.threads)
            close = getattr(episode.env, "close", None)
            if callable(close) and episode.step_timed_out:  # started, not waited on: the module docstring
                closing = asyncio.ensure_future(self._call(close))
                self.unawaited.add(closing)
                closing.add_done_callback(self._forget)
            elif callable(close):
                try:
                    await self._call(close)
                except (UserCodeError, TimeoutError) as e:  # the episode is over; a failing close only warns
                    logger.warning("environment %s close() failed: %s", self.setup.environment, e)
            return reward
        finally:
            episode.scratch.cleanup()


async def serve(conn: Connection, state: HostState) -> None:
    """Answers request batches from `conn` until the parent closes it (see the module docstring), then exits
    the process."""
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    outbox: list = []

    def flush() -> None:
        try:
            conn.send(list(outbox))
        except OSError:
            closed.set()
        outbox.clear()

    async def answer(rid: int, op: str, tid: int, payload: Any) -> None:
        result = await state.handle(op, tid, payload)
        if not outbox:
            loop.call_soon(flush)
        outbox.append((rid, result))

    def readable() -> None:
        try:
            while conn.poll():
                for rid, op, tid, payload in conn.recv():
                    loop.create_task(answer(rid, op, tid, payload))
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            closed.set()

    loop.add_reader(conn.fileno(), readable)
    await closed.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not waiting for threads still running user code


def main() -> None:
    conn = parent_connection()
    ignore_stop_signals()
    cap_prints()
    try:
        setup = conn.recv()
    except (EOFError, OSError):  # the parent stopped before handing over the setup: nothing to do
        os._exit(0)
    reply: tuple[str, Any]
    try:
        state = HostState(setup)
        reply = ("ready", state.schemas)
    except BaseException as e:  # noqa: BLE001 - anything that stops the start is the parent's error to show
        reply = ("failed", str(e))
    try:
        conn.send(reply)
    except OSError:  # the parent stopped meanwhile
        os._exit(0)
    if reply[0] == "ready":
        asyncio.run(serve(conn, state))
    os._exit(0)


if __name__ == "__main__":
    main()
