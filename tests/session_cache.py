"""Artifacts that a test session builds once, however many pytest-xdist workers it runs.

With xdist each worker is a session of its own, so a `scope="session"` fixture runs once per worker: an
expensive one (a trained model, a converted checkpoint, a reference run) would be built twice, at the same
time, on the same two cores. `built_once` builds it in a directory every worker of the run shares (the
parent of the workers' own base temporary directories), under a file lock: the first worker builds it, the
others wait and read it. Without xdist it is an ordinary session-scoped directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

DONE = ".built"  # written last: a directory without it is a build that did not finish


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on the file `path` (created if missing) for the block."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory every worker of this run sees (this session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `name`, filled by `build(directory)` once per test run (the first worker to ask)."""
    root = shared_root(tmp_path_factory)
    out = root / name
    with locked(root / f"{name}.lock"):
        if not (out / DONE).is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            build(out)
            (out / DONE).touch()
    return out
