"""`ScoringPool`: reward functions run in spawned processes with a per-sample timeout.

Each worker process loads the reward function itself from its spec (so user functions need no
pickling), tells the pool it is ready, then scores chunks of rows, sending one result per row. The pool
sends a chunk only to an idle worker, so the controller never blocks on a busy one. A row that raises
gives an ``error`` outcome; a row still running `timeout_s` after it started gives ``timeout``: that
worker is killed, a fresh one is started, and the rest of its chunk goes back to the queue. A worker
that dies (segfault, ``os._exit``) costs only the row it was on.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

# (data_source, solution_str, ground_truth, extra_info)
Row = tuple[str, str, Any, Any]
# ("ok", (score, extras)) | ("error", message) | ("timeout", message)
Outcome = tuple[str, Any]

_MAX_CHUNK = 16
_STARTUP_TIMEOUT_S = 300.0


def _worker_main(spec: Any, fn_kwargs: dict | None, conn: Connection) -> None:
    """Worker process body: load the function, then score ``[(index, row), ...]`` chunks until ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    from hybridflow.rewards.registry import get_reward_fn, split_result

    try:
        fn = get_reward_fn(spec, fn_kwargs)
    except BaseException as e:  # reported to the controller, which raises it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while (msg := conn.recv()) is not None:
        for index, row in msg:
            try:
                outcome: Outcome = ("ok", split_result(fn(*row)))
            except (Exception, SystemExit) as e:
                outcome = ("error", f"{type(e).__name__}: {e}")
            conn.send((index, outcome))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    inflight: deque = field(default_factory=deque)  # row indices sent, in order
    head_started: float = 0.0  # when the row at inflight[0] began
    spawned: float = field(default_factory=time.monotonic)


class ScoringPool:
    """`num_workers` spawned processes scoring rows with the reward function named by `spec`.

    Args:
        spec: a reward spec for `get_reward_fn` (a name, ``auto``, ``file.py:fn``) or a picklable callable.
        fn_kwargs: keyword arguments bound to the function.
        num_workers: number of processes (>= 1).
        timeout_s: per-row limit in seconds; None or <= 0 for no limit.
    """

    def __init__(self, spec: Any, fn_kwargs: dict | None, num_workers: int, timeout_s: float | None) -> None:
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        self.spec, self.fn_kwargs = spec, fn_kwargs
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self._ctx = mp.get_context("spawn")
        self._workers = [self._start() for _ in range(num_workers)]
        self.restarts = 0

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(self.spec, self.fn_kwargs, child),
                                    daemon=True, name="hybridflow-reward")
        process.start()
        child.close()
        return _Worker(process, parent)

    def _replace(self, i: int) -> None:
        worker = self._workers[i]
        worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        self._workers[i] = self._start()
        self.restarts += 1

    def run(self, rows: list[Row]) -> list[Outcome]:
        """Scores every row; returns one outcome per row, in order. Blocks until all are done."""
        outcomes: list[Outcome | None] = [None] * len(rows)
        queue = deque(range(len(rows)))
        while queue or any(w.inflight for w in self._workers):
            self._dispatch(rows, queue)
            self._collect(outcomes, queue)
        return outcomes  # type: ignore[return-value]

    def _dispatch(self, rows: list[Row], queue: deque) -> None:
        idle = [w for w in self._workers if w.ready and not w.inflight]
        for worker in idle:
            if not queue:
                return
            size = max(1, min(_MAX_CHUNK, len(queue) // (2 * len(self._workers))))
            indices = [queue.popleft() for _ in range(min(size, len(queue)))]
            try:
                worker.conn.send([(i, rows[i]) for i in indices])
            except OSError:  # the worker died while idle: `_collect` sees its EOF and replaces it
                queue.extendleft(reversed(indices))
                continue
            worker.inflight.extend(indices)
            worker.head_started = time.monotonic()

    def _collect(self, outcomes: list, queue: deque) -> None:
        now = time.monotonic()
        deadlines = [w.head_started + self.timeout_s for w in self._workers
                     if self.timeout_s and w.ready and w.inflight]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else 1.0
        ready = wait([w.conn for w in self._workers], timeout=wait_s)
        for i, worker in enumerate(self._workers):
            if worker.conn in ready:
                self._drain(i, outcomes, queue)
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            if self.timeout_s and worker.ready and worker.inflight and now - worker.head_started > self.timeout_s:
                self._fail_head(i, outcomes, queue, ("timeout", f"no result within {self.timeout_s:g} s"))
            elif not worker.ready and now - worker.spawned > _STARTUP_TIMEOUT_S:
                raise RuntimeError(f"reward worker did not start within {_STARTUP_TIMEOUT_S:g} s "
                                   f"(loading reward function {self.spec!r})")

    def _drain(self, i: int, outcomes: list, queue: deque) -> None:
        worker = self._workers[i]
        try:
            while worker.conn.poll():
                tag, payload = worker.conn.recv()
                if tag == "ready":
                    worker.ready, worker.head_started = True, time.monotonic()
                elif tag == "failed":
                    raise RuntimeError(f"reward worker could not load reward function {self.spec!r}: {payload}")
                else:
                    expected = worker.inflight.popleft()
                    if tag != expected:
                        raise RuntimeError(f"reward worker answered row {tag}, expected row {expected}")
                    outcomes[tag] = payload
                    worker.head_started = time.monotonic()
        except (EOFError, OSError):
            worker.process.join(timeout=1)
            code = worker.process.exitcode
            if not worker.ready:
                raise RuntimeError(f"reward worker exited with code {code} while loading {self.spec!r}") from None
            if worker.inflight:
                self._fail_head(i, outcomes, queue, ("error", f"reward worker died (exit code {code})"))
            else:
                self._replace(i)

    def _fail_head(self, i: int, outcomes: list, queue: deque, outcome: Outcome) -> None:
        """Records `outcome` for the worker's current row, requeues the rest, and replaces the worker."""
        worker = self._workers[i]
        head = worker.inflight.popleft()
        outcomes[head] = outcome
        logger.warning("reward row %d: %s; restarting the reward worker", head, outcome[1])
        queue.extendleft(reversed(worker.inflight))
        self._replace(i)

    def close(self) -> None:
        """Asks each worker to exit, then kills any that does not within a second."""
        for worker in self._workers:
            try:
                if worker.ready:
                    worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=1)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.conn.close()
        self._workers = []
