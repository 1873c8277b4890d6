"""Errors a worker group raises in the controller: a worker's exception, a worker's death."""

from __future__ import annotations

import signal


class WorkerError(RuntimeError):
    """A worker method raised; the message carries the role, the rank and the worker's traceback."""

    def __init__(self, role: str, rank: int, method: str, traceback_text: str) -> None:
        self.role, self.rank, self.method, self.traceback_text = role, rank, method, traceback_text
        last = traceback_text.strip().splitlines()[-1] if traceback_text.strip() else "unknown error"
        super().__init__(
            f"({role} rank {rank}) {method} failed: {last}\n"
            f"--- traceback in worker {role} rank {rank} ---\n{traceback_text.rstrip()}"
        )


def describe_exit(exitcode: int | None) -> str:
    """`-9` -> 'killed by signal SIGKILL'; `1` -> 'exit code 1'; None -> 'exit status unknown'."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class WorkerDiedError(RuntimeError):
    """A worker process ended while the controller was waiting on it (crash, SIGKILL, OOM)."""

    def __init__(self, role: str, rank: int, how: str, detail: str = "") -> None:
        self.role, self.rank, self.how = role, rank, how
        extra = f"\n{detail.rstrip()}" if detail else ""
        super().__init__(
            f"worker {role} rank {rank} died ({how}); the group '{role}' is unusable, "
            f"shut it down and start a new one{extra}"
        )


class WorkerUnresponsiveError(WorkerDiedError):
    """A worker process sent no heartbeat for the group's `worker_timeout_s` while the controller waited on
    it (stopped by SIGSTOP or a debugger, frozen, its machine overloaded): treated as dead."""

    def __init__(self, role: str, rank: int, where: str, silent_s: float, timeout_s: float, method: str) -> None:
        self.role, self.rank, self.how = role, rank, f"{where}, unresponsive"
        RuntimeError.__init__(
            self,
            f"worker {role} rank {rank} ({where}) is unresponsive: no heartbeat for {silent_s:.0f} s "
            f"(trainer.worker_timeout_s={timeout_s:g}) while the controller waited on {method}. It is stopped "
            f"(SIGSTOP, a debugger), frozen in native code, or its machine is overloaded; the group '{role}' "
            f"is unusable, shut it down and start a new one"
        )
