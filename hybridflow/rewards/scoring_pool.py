"""`ScoringPool`: reward functions run in spawned processes with a per-sample timeout.

Each worker process builds the `Scorer` itself from its `RewardSpec` (so user functions need no
pickling), tells the pool it is ready, then scores chunks of jobs: a row each for per-row functions, a
whole batch for a batched one (`hybridflow.rewards.scorer`); "row" below means either. The pool sends a chunk only to an
idle worker, so the controller never blocks on a busy one. Results come back in batches (every
`_FLUSH_S` seconds and at the end of a chunk), so a fast rule-based reward costs microseconds of IPC
per row; the worker publishes the row it is on, and when it started, in a small shared-memory slot,
which is what the timeout watches.

A row that raises gives an ``error`` outcome. A row still running `timeout_s` after it started gives
``timeout``: that worker is killed, a fresh one is started, and the rest of its chunk (including rows
it had finished but not yet reported) goes back to the queue. A worker that dies (segfault,
``os._exit``) costs only the row it was on.

After a timeout the pool scores *isolated* until a batch passes without one: each worker forks one child
per row of its chunk (up to `_MAX_FORKS` at once) and kills the children still running at `timeout_s`, so
rows that hang time out together, not one after another (a batch where every row hangs costs about one
`timeout_s`, not one per row), and the worker itself survives them.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import pickle
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, BinaryIO, cast

from hybridflow.rewards.scorer import Job, RewardSpec
from hybridflow.utils.child_process import cap_prints, die_with_parent, print_budget
from hybridflow.utils.stop_signals import held_signals, ignore_stop_signals

logger = logging.getLogger(__name__)

# ("ok", the Scorer's payload) | ("error", message) | ("timeout", message)
Outcome = tuple[str, Any]

_MAX_CHUNK = 64
_MAX_FORKS = 64  # rows one worker scores at once when isolated
_ISOLATED_GRACE_S = 10.0  # beyond its rows' timeouts, before an isolated chunk's worker is given up
_FLUSH_S = 0.02
_STARTUP_TIMEOUT_S = 300.0
_IDLE = -1.0  # value of the shared "current row" slot between rows


def _worker_main(spec: RewardSpec, conn: Connection, current: Any, parent_pid: int) -> None:
    """Worker process body: build the scorer, then score ``[(index, job), ...]`` chunks until ``None``.

    `current` is a shared ``[row index, start time]`` pair; the index is set to `_IDLE` while the pair
    is being written and between rows, so the controller never reads a torn pair. The worker dies with the
    controller (even one killed by SIGKILL) and what the function prints is capped per row.
    """
    die_with_parent(parent_pid)
    ignore_stop_signals()  # Ctrl-C and SIGTERM to the run are the controller's to handle
    cap_prints()
    from hybridflow.rewards.scorer import Scorer

    try:
        fn = Scorer(spec)
    except BaseException as e:  # reported to the controller, which raises it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while (chunk := conn.recv()) is not None:
        if isinstance(chunk, tuple):  # ("isolated", timeout_s, rows)
            _score_isolated(fn, chunk[2], chunk[1], conn)
            continue
        results: list[tuple[int, Outcome]] = []
        flushed = time.monotonic()
        for index, row in chunk:
            current[0], current[1] = _IDLE, time.monotonic()
            current[0] = float(index)
            results.append((index, _score_in_worker(fn, row)))
            if time.monotonic() - flushed > _FLUSH_S:
                conn.send(results)
                results, flushed = [], time.monotonic()
        current[0] = _IDLE
        if results:
            conn.send(results)


def score_job(fn: Any, job: Job) -> Outcome:
    """The outcome of one job (`Scorer.__call__`); an exception, or a user's ``sys.exit()``, is an error."""
    try:
        return ("ok", fn(job))
    except (Exception, SystemExit) as e:
        return ("error", f"{type(e).__name__}: {e}")


def _score_in_worker(fn: Any, job: Job) -> Outcome:
    """`score_job` in a worker process, what the function prints capped; no signal reaches a worker, so a
    `KeyboardInterrupt` is the function's own, the job's error too."""
    try:
        with print_budget():
            return score_job(fn, job)
    except KeyboardInterrupt as e:
        return ("error", f"{type(e).__name__}: {e}")


def _fork_score(fn: Any, row: Job) -> tuple[int, BinaryIO]:
    """Forks a child that scores `row` and writes its pickled outcome to a pipe; returns (pid, pipe reader)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: score, report, leave without running the parent's cleanup
        try:
            os.close(read_fd)
            with os.fdopen(write_fd, "wb") as out:
                out.write(pickle.dumps(_score_in_worker(fn, row)))
        finally:
            os._exit(0)
    os.close(write_fd)
    return pid, os.fdopen(read_fd, "rb")


def _score_isolated(fn: Any, chunk: list[tuple[int, Job]], timeout_s: float, conn: Connection) -> None:
    """Scores each row in a forked child of this worker, up to `_MAX_FORKS` at once; a child still running
    `timeout_s` after it started is killed and its row reported as a timeout."""
    queue = deque(chunk)
    running: dict[BinaryIO, tuple[int, int, float]] = {}  # reader -> (row index, child pid, start time)
    while queue or running:
        while queue and len(running) < _MAX_FORKS:
            index, row = queue.popleft()
            pid, reader = _fork_score(fn, row)
            running[reader] = (index, pid, time.monotonic())
        first_deadline = min(start for _, _, start in running.values()) + timeout_s
        results = []
        readers: list[Any] = list(running)  # wait takes any object with a fileno and returns those ready
        for ready in wait(readers, timeout=max(0.0, first_deadline - time.monotonic())):
            reader = cast(BinaryIO, ready)
            index, pid, _ = running.pop(reader)
            data = reader.read()
            reader.close()
            _, status = os.waitpid(pid, 0)
            outcome = pickle.loads(data) if data else (
                "error", f"reward function process died ({os.waitstatus_to_exitcode(status)})")
            results.append((index, outcome))
        now = time.monotonic()
        for reader, (index, pid, start) in list(running.items()):
            if now - start > timeout_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                reader.close()
                del running[reader]
                results.append((index, ("timeout", f"no result within {timeout_s:g} s")))
        if results:
            conn.send(results)


@dataclass
class _Worker:
    process: Any
    conn: Connection
    current: Any  # shared [row index or _IDLE, start time]
    ready: bool = False
    inflight: set = field(default_factory=set)  # row indices sent and not yet answered
    spawned: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # when an isolated chunk's worker is given up (None: not isolated)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def running(self) -> tuple[int, float] | None:
        """``(row index, start time)`` of the row the worker is scoring, or None between rows."""
        index, started = self.current[0], self.current[1]
        if index == _IDLE or self.current[0] != index or int(index) not in self.inflight:
            return None
        return int(index), started


class ScoringPool:
    """`num_workers` spawned processes scoring rows with the reward function named by `spec`.

    Args:
        spec: the reward functions (their specs: names, ``auto``, ``file.py:fn``, picklable callables).
        num_workers: number of processes (>= 1).
        timeout_s: per-row limit in seconds; None or <= 0 for no limit.
    """

    def __init__(self, spec: RewardSpec, num_workers: int, timeout_s: float | None) -> None:
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        self.spec = spec
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        try:
            for slot in range(num_workers):
                self._start(slot)
        except BaseException:  # a stop signal, answered as a start ends: the processes started so far end too
            for worker in self._workers:
                worker.kill()
            raise
        self.restarts = 0
        self.isolated = False  # score each row in its own forked child (after a timeout; module docstring)
        self._timed_out = False

    def _start(self, slot: int) -> None:
        """Starts worker `slot`'s process (a new slot at the list's end, or a replacement)."""
        parent, child = self._ctx.Pipe(duplex=True)
        current = self._ctx.Array("d", [_IDLE, 0.0], lock=False)
        process = self._ctx.Process(target=_worker_main, args=(self.spec, child, current, os.getpid()),
                                    daemon=True, name="hybridflow-reward")
        with held_signals():  # a stop now would leave the new process without its work, printing a traceback
            process.start()
            child.close()
            # in the list before a held signal is answered (at the block's end), so that whoever stops the pool
            # stops this process too
            worker = _Worker(process, parent, current)
            if slot == len(self._workers):
                self._workers.append(worker)
            else:
                self._workers[slot] = worker

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._start(i)
        self.restarts += 1

    def run(self, rows: list[Job]) -> list[Outcome]:
        """Scores every row; returns one outcome per row, in order. Blocks until all are done."""
        outcomes: list[Outcome | None] = [None] * len(rows)
        queue = deque(range(len(rows)))
        self._timed_out = False
        while queue or any(w.inflight for w in self._workers):
            self._dispatch(rows, queue)
            self._collect(outcomes, queue)
        self.isolated = self._timed_out and self.timeout_s is not None
        return outcomes  # type: ignore[return-value]

    def _dispatch(self, rows: list[Job], queue: deque) -> None:
        for worker in self._workers:
            if not queue:
                return
            if not worker.ready or worker.inflight:
                continue
            if self.isolated:  # every row at once, spread over the idle workers
                idle = sum(1 for w in self._workers if w.ready and not w.inflight)
                size = min(_MAX_FORKS, math.ceil(len(queue) / idle))
            else:
                size = max(1, min(_MAX_CHUNK, len(queue) // (4 * len(self._workers))))
            indices = [queue.popleft() for _ in range(min(size, len(queue)))]
            chunk = [(i, rows[i]) for i in indices]
            try:
                worker.conn.send(("isolated", self.timeout_s, chunk) if self.isolated else chunk)
            except OSError:  # the worker died while idle: `_collect` sees its EOF and replaces it
                queue.extendleft(reversed(indices))
                continue
            worker.inflight.update(indices)
            timeout_s = self.timeout_s  # set whenever isolated
            worker.deadline = (time.monotonic() + timeout_s + _ISOLATED_GRACE_S
                               if self.isolated and timeout_s is not None else None)

    def _collect(self, outcomes: list, queue: deque) -> None:
        wait_s, timeout_s = 1.0, self.timeout_s
        if timeout_s:
            for worker in self._workers:
                if worker.ready and worker.inflight:
                    running = worker.running()
                    # Between rows the slot is idle for microseconds: look again soon.
                    left = running[1] + timeout_s - time.monotonic() if running else _FLUSH_S
                    wait_s = min(wait_s, max(0.0, left))
        ready = wait([w.conn for w in self._workers], timeout=wait_s)
        for i, worker in enumerate(self._workers):
            if worker.conn in ready:
                self._drain(i, outcomes, queue)
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            running = worker.running() if timeout_s and worker.ready and worker.inflight else None
            if running and timeout_s and now - running[1] > timeout_s:
                self._fail(i, running[0], outcomes, queue, ("timeout", f"no result within {timeout_s:g} s"))
            elif worker.deadline is not None and worker.inflight and now > worker.deadline:
                logger.warning("reward worker stuck on %d isolated rows; restarting it", len(worker.inflight))
                for index in worker.inflight:
                    outcomes[index] = ("timeout", f"no result within {self.timeout_s:g} s")
                worker.inflight.clear()
                self._replace(i)
            elif not worker.ready and now - worker.spawned > _STARTUP_TIMEOUT_S:
                raise RuntimeError(f"reward worker did not start within {_STARTUP_TIMEOUT_S:g} s "
                                   f"(loading reward function {self.spec.label()})")

    def _drain(self, i: int, outcomes: list, queue: deque) -> None:
        worker = self._workers[i]
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if isinstance(message, list):
                    for index, outcome in message:
                        worker.inflight.discard(index)
                        outcomes[index] = outcome
                        self._timed_out |= outcome[0] == "timeout"
                elif message[0] == "ready":
                    worker.ready = True
                else:
                    raise RuntimeError(f"reward worker could not load reward function {self.spec.label()}: {message[1]}")
        except (EOFError, OSError):
            worker.process.join(timeout=1)
            code = worker.process.exitcode
            if not worker.ready:
                raise RuntimeError(f"reward worker exited with code {code} while loading {self.spec.label()}") from None
            if worker.inflight:
                running = worker.running()
                culprit = running[0] if running else min(worker.inflight)
                self._fail(i, culprit, outcomes, queue, ("error", f"reward worker died (exit code {code})"))
            else:
                self._replace(i)

    def _fail(self, i: int, index: int, outcomes: list, queue: deque, outcome: Outcome) -> None:
        """Records `outcome` for row `index`, requeues the worker's other rows, and replaces the worker."""
        worker = self._workers[i]
        worker.inflight.discard(index)
        outcomes[index] = outcome
        if outcome[0] == "timeout":
            self._timed_out = self.isolated = True
        logger.warning("reward row %d: %s; restarting the reward worker", index, outcome[1])
        queue.extendleft(sorted(worker.inflight, reverse=True))
        worker.inflight.clear()
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
