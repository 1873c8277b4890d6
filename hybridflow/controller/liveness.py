"""`Liveness`: a worker the controller waits on that falls silent is reported, instead of waited on forever.

Every worker process sends a heartbeat to the controller's log server each second (`controller.logs`).
While a call to a rank is pending, a watcher thread compares that rank's silence with `timeout_s`; past it,
the rank's pending calls fail with `WorkerUnresponsiveError` (role, rank, pid, the call) and the backend
marks the rank dead, as if its process had ended. A healthy worker's heartbeat thread runs whatever its
main thread does (torch releases the GIL), so only a process that is stopped (SIGSTOP, a debugger), frozen
in native code holding the GIL, or starved of CPU falls silent. A rank is watched from its first
heartbeat on; start-up has its own timeout (the process group's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from hybridflow.controller.errors import WorkerUnresponsiveError


class Liveness:
    """Watches the ranks of one group; see the module docstring.

    Args:
        role: the group's name, for messages.
        server: the `LogServer` the group's workers send heartbeats to.
        keys: each rank's key on that server.
        describe: rank -> where it runs (``"pid 4242"``), for messages.
        timeout_s: seconds of silence, while a call is pending, before the rank is given up.
        on_silent: called once with (rank, error) when a rank is given up.
    """

    def __init__(self, role: str, server: Any, keys: list[str], describe: Callable[[int], str], timeout_s: float,
                 on_silent: Callable[[int, Exception], None]) -> None:
        self.role, self.server, self.keys, self.describe = role, server, keys, describe
        self.timeout_s, self.on_silent = timeout_s, on_silent
        self._pending: list[dict[Future, str]] = [{} for _ in keys]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name=f"hybridflow-liveness-{role}", daemon=True).start()

    def track(self, rank: int, future: Future, method: str) -> None:
        """Watch `rank` while `future` (a call of `method`) is pending."""
        with self._lock:
            self._pending[rank][future] = method
        future.add_done_callback(lambda f: self._forget(rank, f))

    def _forget(self, rank: int, future: Future) -> None:
        with self._lock:
            self._pending[rank].pop(future, None)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            for rank, key in enumerate(self.keys):
                with self._lock:
                    pending = dict(self._pending[rank])
                silent = self.server.silence(key)
                if pending and silent is not None and silent > self.timeout_s:
                    self._give_up(rank, pending, silent)

    def _give_up(self, rank: int, pending: dict[Future, str], silent: float) -> None:
        error = WorkerUnresponsiveError(self.role, rank, self.describe(rank), silent, self.timeout_s,
                                        ", ".join(sorted(set(pending.values()))))
        self.on_silent(rank, error)
        for future in pending:
            fail(future, error)

    def close(self) -> None:
        self._stop.set()


def fail(future: Future, error: BaseException) -> None:
    """Fail `future` unless it is already settled (a rank given up may still answer later)."""
    if not future.done():
        try:
            future.set_exception(error)
        except Exception:  # noqa: BLE001 - InvalidStateError: settled between the check and the set
            pass
