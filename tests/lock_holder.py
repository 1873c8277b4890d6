"""`another_run_holding(path)`: a second process that takes `path`'s run lock (`RunLock`) and keeps it, as a live run
would, until the block ends, when it is killed without releasing it (its lock file stays behind, stale)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

HOLD = "import sys, time; from hybridflow.checkpoint import RunLock; RunLock(sys.argv[1]); print('locked', flush=True); " \
       "time.sleep(120)"


@contextlib.contextmanager
def another_run_holding(path: str | Path) -> Iterator[subprocess.Popen]:
    """The holding process, once it holds the lock."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()
