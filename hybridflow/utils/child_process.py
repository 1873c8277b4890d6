"""Processes that run user code (reward functions, environments, tools, agent runners): how they are started,
and what they set up first. They die with the process that started them, even one killed by SIGKILL, and
what the user code prints is capped per call, so a loop of prints cannot flood the run's logs.

    process, conn = spawn_module("hybridflow.agents.loop.host_process")   # in the parent
    conn.send(plain(row))              # what crosses the pipe: builtins only
    conn = parent_connection()         # in the child: its end of the pipe; it now dies with the parent
    die_with_parent(parent_pid)        # a parent-death signal: SIGKILL when the parent is gone
    cap_prints()                       # once: sys.stdout and sys.stderr obey the budgets below
    with print_budget():               # around each call of user code: PRINT_CAP_CHARS (per thread or task)
        fn(...)

Output outside a `print_budget` block passes as it is. The cap holds for what goes through `sys.stdout` and
`sys.stderr` (print, logging to the console, tracebacks); a write to file descriptor 1 or 2 itself (`os.write`,
a C library's printf) is not seen.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from multiprocessing.connection import Connection
from typing import Any, TextIO

import numpy as np

PRINT_CAP_CHARS = 4096  # per call of user code, stdout and stderr together

_PR_SET_PDEATHSIG = 1
_budget: ContextVar[list[int] | None] = ContextVar("hybridflow_print_budget", default=None)  # [left, cap]


def die_with_parent(parent_pid: int) -> None:
    """Asks the kernel to SIGKILL this process when the thread that started it exits (Linux; elsewhere
    nothing); exits at once if `parent_pid` is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl on this system
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def plain(value: Any) -> Any:
    """`value` as builtins for the pipe: mappings (OmegaConf's included) as dicts, sequences and numpy arrays
    (parquet's list columns) as lists, numpy scalars as numbers."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(v) for v in value]
    return value


def spawn_module(module: str) -> tuple[subprocess.Popen, Connection]:
    """Starts `python -m module FD PARENT_PID` with this process's import path, in a session of its own (so
    `os.killpg` ends it with whatever it started); FD is its end of a socket pair. Returns it and our end."""
    ours, theirs = socket.socketpair()
    with theirs:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno()), str(os.getpid())],
                                   pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True,
                                   env=env)
    return process, Connection(ours.detach())


def parent_connection() -> Connection:
    """In a process `spawn_module` started: its end of the pipe; from now on it dies with its parent."""
    die_with_parent(int(sys.argv[2]))
    return Connection(int(sys.argv[1]))


class _CappedStream:
    """A text stream that passes writes on until the current call's budget is spent, then notes the cut once."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        budget = _budget.get()
        if budget is None:
            return self._stream.write(text)
        if budget[0] > 0:
            self._stream.write(text[:budget[0]])
            budget[0] -= len(text)
            if budget[0] < 0:
                self._stream.write(f"\n[hybridflow: this call printed more than {budget[1]} characters; the rest "
                                   f"is dropped]\n")
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, encoding, isatty, ...
        return getattr(self._stream, name)


def cap_prints() -> None:
    """Wraps `sys.stdout` and `sys.stderr` so each `print_budget` block writes at most its budget."""
    if not isinstance(sys.stdout, _CappedStream):
        sys.stdout = _CappedStream(sys.stdout)
        sys.stderr = _CappedStream(sys.stderr)


@contextlib.contextmanager
def print_budget(cap: int = PRINT_CAP_CHARS) -> Iterator[None]:
    """A fresh budget of `cap` characters for the writes of this block (in this thread or task)."""
    token = _budget.set([cap, cap])
    try:
        yield
    finally:
        _budget.reset(token)
