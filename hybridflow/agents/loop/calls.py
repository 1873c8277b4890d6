"""Calling user code (environments, tools) under a time limit: a sync function runs in a worker thread, an
async one on the loop. Whatever it raises, `SystemExit` and `KeyboardInterrupt` included, comes back as a
`UserCodeError` naming the exception, and a timeout as `TimeoutError`: the caller counts them (an
environment or tool error ends or answers one trajectory, never the run). What it prints is capped per
call (`hybridflow.utils.child_process`)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hybridflow.utils.child_process import print_budget


class UserCodeError(Exception):
    """User code raised; the message is `ExceptionType: text`."""


async def call_with_timeout(fn: Callable[..., Any], *args: Any, timeout_s: float,
                            threads: ThreadPoolExecutor | None = None) -> Any:
    """`fn(*args)` (awaited when it is a coroutine function or returns an awaitable) within `timeout_s`
    seconds; raises `TimeoutError` past it and `UserCodeError` for anything `fn` raises. A sync call that
    outlives its timeout keeps its thread until it returns (Python cannot stop a thread), which is why
    `threads` should be a pool of its own, in a process that can be killed (`hybridflow.agents.loop.host`)."""

    async def run() -> Any:
        with print_budget():
            try:
                if inspect.iscoroutinefunction(fn):
                    result = fn(*args)
                else:
                    call = functools.partial(contextvars.copy_context().run, fn, *args)
                    result = await asyncio.get_running_loop().run_in_executor(threads, call)
                return await result if inspect.isawaitable(result) else result
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # the time limit's cancellation
                    raise
                raise UserCodeError("CancelledError: raised by the call itself") from None
            except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt: one call's failure
                raise UserCodeError(f"{type(e).__name__}: {e}") from None

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None
