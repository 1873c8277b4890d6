"""Worker output reaches the controller's console line by line, prefixed ``(role rank N) `` (`prefix`).

Each worker process points its file descriptors 1 and 2 straight at a TCP connection to the
controller's `LogServer` (`forward_output`), so prints, C++ warnings and NCCL logs all travel; the
server writes every complete line to the controller's *current* ``sys.stdout`` / ``sys.stderr``.
After each call a worker writes a sync mark (`mark_synced`) into both streams, and the backend
waits for it (`LogServer.wait_synced`) before returning the call's result, so a call's output is
on the console before the controller continues.

An inline worker (a one-worker group running in the controller) prints in the controller's own
process: `prefixed_output` gives the lines its calls write to ``sys.stdout`` / ``sys.stderr`` the same
prefix, leaving the controller's other threads' lines as they are.

A third connection carries the worker's heartbeat: a thread sends a byte every `HEARTBEAT_S`, and the
server remembers when each worker was last heard (`LogServer.silence`), which is what
`hybridflow.controller.liveness` watches. The same TCP channel works for local and Ray workers, on this
machine or another; a stopped (SIGSTOP) or frozen process falls silent.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_HEADER_END = b"\n"
_SYNC = "\x1ehybridflow-sync "
SYNC_WAIT_S = 2.0
HEARTBEAT_S = 1.0
_STREAMS = ("stdout", "stderr")
_forwarding = False


class LogServer:
    """Accepts worker output connections and prints their lines with the worker's prefix."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._synced = threading.Condition()
        self._marks: dict[tuple[str, str], int] = {}  # (worker key, stream) -> last call id seen
        self._beats: dict[str, float] = {}  # worker key -> monotonic time of its last heartbeat
        threading.Thread(target=self._accept_loop, name="hybridflow-log-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read_loop, args=(conn,), name="hybridflow-log", daemon=True).start()

    def _read_loop(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            header = json.loads(stream.readline())
            prefix, target, key = header["prefix"], header["stream"], header["key"]
            if target == "heartbeat":
                while stream.read(1):
                    self._beats[key] = time.monotonic()
                return
            for raw in stream:
                line, _, mark = raw.decode("utf-8", errors="replace").partition(_SYNC)
                if line:
                    self._write(target, prefix + line.rstrip("\n") + "\n")
                if mark:
                    with self._synced:
                        self._marks[(key, target)] = int(mark)
                        self._synced.notify_all()

    def wait_synced(self, key: str, call_id: int, timeout: float = SYNC_WAIT_S) -> bool:
        """Waits until both streams of worker `key` have been printed up to call `call_id`'s end."""
        with self._synced:
            return self._synced.wait_for(
                lambda: all(self._marks.get((key, s), -1) >= call_id for s in _STREAMS), timeout
            )

    def silence(self, key: str) -> float | None:
        """Seconds since worker `key`'s last heartbeat; None before its first one."""
        last = self._beats.get(key)
        return None if last is None else time.monotonic() - last

    def _write(self, target: str, text: str) -> None:
        out = sys.stdout if target == "stdout" else sys.stderr
        with self._lock:
            try:
                out.write(text)
                out.flush()
            except (OSError, ValueError):  # the console went away (interpreter shutdown)
                pass


_servers: dict[str, LogServer] = {}
_servers_lock = threading.Lock()


def log_server(host: str = "127.0.0.1") -> LogServer:
    """The controller's log server listening on `host` (started once per host)."""
    with _servers_lock:
        if host not in _servers:
            _servers[host] = LogServer(host)
        return _servers[host]


def forward_output(address: tuple[str, int], prefix: str, key: str) -> None:
    """In a worker process: sends fds 1 and 2 (and Python's sys.stdout/stderr) to the log server, and starts
    the heartbeat.

    `key` names this worker uniquely for `LogServer.wait_synced` and `LogServer.silence`."""
    global _forwarding
    _forwarding = True
    for name, fd, stream in (("stdout", 1, sys.stdout), ("stderr", 2, sys.stderr)):
        stream.flush()
        sock = socket.create_connection(address)
        sock.sendall(json.dumps({"prefix": prefix, "stream": name, "key": key}).encode() + _HEADER_END)
        os.dup2(sock.fileno(), fd)
        sock.close()
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    beat = socket.create_connection(address)
    beat.sendall(json.dumps({"prefix": prefix, "stream": "heartbeat", "key": key}).encode() + _HEADER_END)
    threading.Thread(target=_heartbeat, args=(beat,), name="hybridflow-heartbeat", daemon=True).start()


def _heartbeat(sock: socket.socket) -> None:
    while True:
        try:
            sock.sendall(b".")
        except OSError:  # the controller is gone; the parent watchdog ends this process
            return
        time.sleep(HEARTBEAT_S)


def mark_synced(call_id: int) -> None:
    """In a worker process, after call `call_id`: flushes and marks both forwarded streams."""
    if not _forwarding:
        return
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        stream.flush()
        os.write(fd, f"{_SYNC}{call_id}\n".encode())


def prefix(role: str, rank: int) -> str:
    """The prefix of a worker's output lines."""
    return f"({role} rank {rank}) "


_inline = threading.local()  # .prefix: the prefix of this thread's running inline call; .line_start
_installed_lock = threading.Lock()
_installed = 0  # inline calls running: while > 0, sys.stdout / sys.stderr are `_PrefixingStream`s


class _PrefixingStream:
    """A text stream that starts each line with the writing thread's inline-call prefix (none outside one)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        lead = getattr(_inline, "prefix", None)
        if lead is None:
            return self.stream.write(text)
        pieces = []
        for line in text.splitlines(keepends=True):
            pieces.append(lead + line if _inline.line_start else line)
            _inline.line_start = line.endswith("\n")
        self.stream.write("".join(pieces))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextmanager
def prefixed_output(lead: str) -> Iterator[None]:
    """Within the block, what this thread writes to ``sys.stdout`` / ``sys.stderr`` starts each line with `lead`."""
    global _installed
    with _installed_lock:
        for name in _STREAMS:
            if not isinstance(getattr(sys, name), _PrefixingStream):
                setattr(sys, name, _PrefixingStream(getattr(sys, name)))
        _installed += 1
    _inline.prefix, _inline.line_start = lead, True
    try:
        yield
    finally:
        _inline.prefix = None
        with _installed_lock:
            _installed -= 1
            for name in _STREAMS if not _installed else ():
                stream = getattr(sys, name)
                if isinstance(stream, _PrefixingStream):
                    setattr(sys, name, stream.stream)
