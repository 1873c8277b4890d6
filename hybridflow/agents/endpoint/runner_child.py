"""The runner host's child process: agent runners (user code) run here, never in a trainer process.

    python -m hybridflow.agents.endpoint.runner_child FD PARENT_PID   # `RunnerHost` starts it (`spawn_module`)

It receives ("init", spec, kwargs) and loads the runner (`path/to/file.py:fn`, or `package.module:fn` for
the built-in adapters), answers ("ready",) or ("init_error", why), then runs each ("run", job, row,
base_url, api_key) as a task on one asyncio loop: `fn(client, row, **kwargs)` with an `openai.AsyncOpenAI`
client on that trajectory's base URL (one shared connection pool; no retries, so the runner sees errors as
they are; an hour's request timeout, since the endpoint always answers). Each task answers ("done", job,
reward, metrics) or ("error", job, why); ("cancel", job) cancels one. When the parent's end closes, the
process exits; it dies with its parent too (`parent_connection`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
from multiprocessing.connection import Connection
from typing import Any

from hybridflow.utils.child_process import parent_connection

REQUEST_TIMEOUT_S = 3600.0  # a request waits for the engine as long as the rollout phase needs (its own limit)


def load_runner(spec: str) -> Any:
    """The runner function named by `spec`."""
    from hybridflow.utils.imports import load_from_file

    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        fn = load_from_file(spec, "agent runner", "function", "agent.runner")
    else:
        fn = getattr(importlib.import_module(target), name)
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"agent.runner={spec!r} must be an `async def` function (it gets an openai.AsyncOpenAI "
                        f"client), got {fn!r:.80}")
    return fn


def as_result(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from what a runner returned: a number, or {"reward": number, "metrics": {name: number}}."""
    metrics: Any = {}
    if isinstance(value, dict):
        reward, metrics = value.get("reward"), value.get("metrics") or {}
    else:
        reward = value
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TypeError(f"the runner returned {value!r:.120}; return a finite number (the reward) or "
                        f"{{'reward': number, 'metrics': {{name: number}}}}")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                and not isinstance(v, bool) for k, v in metrics.items()):
        raise TypeError(f"the runner's metrics must be a {{name: number}} mapping, got {metrics!r:.120}")
    return float(reward), {k: float(v) for k, v in metrics.items()}


def http_client(openai: Any) -> Any:
    """One connection pool for every trajectory's client: aiohttp's transport where it is installed (the
    `agents` extra's `openai[aiohttp]`: ~30 % less CPU per request than httpx's, docs/agents.md), else httpx's.
    Proxy settings in the environment are ignored: the endpoint is always on 127.0.0.1, and a cluster's
    HTTP(S)_PROXY without a NO_PROXY for it would send every request to the proxy."""
    try:
        return openai.DefaultAioHttpClient(trust_env=False)
    except RuntimeError:  # openai's stand-in when aiohttp is missing
        return openai.DefaultAsyncHttpxClient(trust_env=False)


async def serve(conn: Connection, runner: Any, kwargs: dict[str, Any]) -> None:
    import openai

    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    http = http_client(openai)
    tasks: dict[str, asyncio.Task] = {}

    def read() -> None:  # a thread: the loop never blocks on the socket
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(inbox.put_nowait, None)
                return
            loop.call_soon_threadsafe(inbox.put_nowait, message)

    async def run(job: str, row: dict[str, Any], base_url: str, api_key: str) -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http, max_retries=0,
                                    timeout=REQUEST_TIMEOUT_S)
        try:
            value = await runner(client, row, **kwargs)
            conn.send(("done", job, *as_result(value)))
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # noqa: BLE001 - a runner's failure is its trajectory's, reported
            conn.send(("error", job, f"{type(e).__name__}: {e}"[:2000]))
        finally:
            tasks.pop(job, None)

    threading.Thread(target=read, daemon=True, name="runner-inbox").start()
    conn.send(("ready",))
    try:
        while (message := await inbox.get()) is not None:
            if message[0] == "run":
                tasks[message[1]] = asyncio.create_task(run(*message[1:]))
            elif message[0] == "cancel" and message[1] in tasks:
                tasks.pop(message[1]).cancel()
    finally:  # the parent is gone: the pool closes before the loop does (aiohttp warns of an unclosed session)
        for task in list(tasks.values()):
            task.cancel()
        await http.aclose()


def main() -> None:
    conn = parent_connection()
    _, spec, kwargs = conn.recv()
    try:
        runner = load_runner(spec)
    except BaseException as e:  # noqa: BLE001 - told to the parent, which names it in its error
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    asyncio.run(serve(conn, runner, kwargs))


if __name__ == "__main__":
    main()
