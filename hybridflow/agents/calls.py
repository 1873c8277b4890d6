"""Calling user code from the agent loop: a sync function runs in a worker thread, an async one on the
loop, both under a time limit; whatever it raises, or a timeout, comes back as an exception the caller
counts (an environment or tool error ends or answers one trajectory, never the run)."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


async def call_with_timeout(fn: Callable[..., Any], *args: Any, timeout_s: float,
                            threads: ThreadPoolExecutor | None = None) -> Any:
    """`fn(*args)` (awaited when it is a coroutine function or returns an awaitable) within `timeout_s`
    seconds; raises `TimeoutError` past it. A sync call that outlives its timeout keeps its thread
    until it returns (Python cannot stop a thread), which is why `threads` should be a pool of its own."""

    async def run() -> Any:
        if inspect.iscoroutinefunction(fn):
            result = fn(*args)
        else:
            result = await asyncio.get_running_loop().run_in_executor(threads, functools.partial(fn, *args))
        return await result if inspect.isawaitable(result) else result

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None
