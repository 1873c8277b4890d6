"""`RunLock`: one run at a time per output directory.

A run holds an exclusive `flock` on `<output_dir>/.hybridflow.lock` from before its first write until it
ends, and writes who it is into the file (pid, host, start time, command line). A second run on the same
directory fails at once with `CheckpointError` naming the running one. The kernel drops the lock when its
process ends, however it ends (SIGKILL, a crash), so a lock file left behind by a dead run is stale by
construction: the next run takes it over and says whose it was. `check_unlocked` refuses a directory a live run
holds without taking its lock (`hybridflow config`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from hybridflow.checkpoint.manifest import CheckpointError

LOCK_FILE = ".hybridflow.lock"


def _holder(text: str) -> str:
    """`pid 4242 on host h1 since 2026-12-03 15:04:05 (hybridflow train ...)` from a lock file's text."""
    try:
        info = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["time"]))
        return f"pid {info['pid']} on host {info['host']} since {since} ({info['command']})"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"


def in_use(output_dir: Path, text: str) -> CheckpointError:
    """The refusal of `output_dir`, whose lock a live run holds (`text`: its lock file's record)."""
    return CheckpointError(f"trainer.output_dir={output_dir} is in use by another run: {_holder(text)}; wait for it "
                           f"to end, stop it, or choose another trainer.output_dir")


def check_unlocked(output_dir: str | Path) -> None:
    """Refuses (`in_use`) an `output_dir` whose lock a live run holds, taking nothing and writing nothing: a flock can
    only be asked by trying it, so a shared one is tried and let go at once (it conflicts only with a run taking the
    lock in that same instant)."""
    path = Path(output_dir).expanduser().resolve() / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):  # no lock file (or no directory): no run holds it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise in_use(path.parent, os.pread(fd, 4096, 0).decode(errors="replace")) from None
    finally:
        os.close(fd)  # drops the shared lock with it


class RunLock:
    """Takes the lock of `output_dir` (see the module docstring); `release()` gives it back."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.stale_holder: str | None = None  # who held a lock file found unlocked (a run that is gone)
        self._fd: int | None = None
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                raise in_use(self.path.parent, text) from None
            if not self._same_file(fd):  # the holder removed the file between our open and lock: retry
                os.close(fd)
                continue
            self._fd = fd
        previous = os.pread(self._fd, 4096, 0).decode(errors="replace")
        if previous.strip():
            self.stale_holder = _holder(previous)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                  "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300]}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
