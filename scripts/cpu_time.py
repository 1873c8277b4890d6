"""Runs a command and reports its wall time and the CPU time of every process it started, orphans included.

`/usr/bin/time` counts only the descendants that were waited for up the chain, so it misses what the tests
start and orphan: Ray's daemons and workers, a multiprocessing fork server's children. Here this process is a
child subreaper (Linux `prctl(PR_SET_CHILD_SUBREAPER)`): orphans are re-parented to it, it reaps them after the
command exits (for up to a minute), and their CPU joins `getrusage(RUSAGE_CHILDREN)`. Used for the per-module
measurements of docs/testing.md:

    python scripts/cpu_time.py python -m pytest -q -p no:cacheprovider tests/workers/test_mismatch_worker.py
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    start = time.monotonic()
    status = subprocess.call(sys.argv[1:])
    wall = time.monotonic() - start
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the orphans re-parented to this process
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.2)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"cpu_time: exit {status}, wall {wall:.1f} s, user {usage.ru_utime:.1f} s, sys {usage.ru_stime:.1f} s, "
          f"cpu {usage.ru_utime + usage.ru_stime:.1f} s", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
