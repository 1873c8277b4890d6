"""The jsonl logger: ``<output_dir>/metrics.jsonl`` (one object per step), ``samples.jsonl`` and
``rollouts.jsonl`` (token-level records of training rows: `hybridflow.tracking.rollout_records`).

Each line is appended with one unbuffered write, so a crash loses nothing already logged, old lines are
never rewritten, and a resumed run appends after them (readers keep the last line for a step that appears
twice). A last line torn by a crash or a full disk (no newline at its end) is repaired when the file is
opened again: ended with a newline when it is whole JSON, cut off otherwise (a warning says how many
bytes), so the next line starts on a line of its own. A write that fails (a full disk) is undone and
raises `LogWriteError` naming the file. Non-finite numbers are written as ``null`` so every line is strict
JSON.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class LogWriteError(Exception):
    """A metrics or samples line could not be written (its path and the reason in the message)."""


def _strict(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def repair_last_line(path: Path) -> None:
    """Ends a torn last line of `path` (see the module docstring); nothing when the file ends well or is absent."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0 or not path.is_file():
        return
    with open(path, "rb+") as f:
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return
        start = size
        while start > 0:  # back to the start of the last line, a block at a time
            step = min(65536, start)
            f.seek(start - step)
            block = f.read(step)
            newline = block.rfind(b"\n")
            if newline >= 0:
                start = start - step + newline + 1
                break
            start -= step
        f.seek(start)
        tail = f.read()
        try:
            json.loads(tail)
        except ValueError:
            f.truncate(start)
            logger.warning("%s: dropped a torn last line (%d bytes) left by a run that stopped mid-write", path,
                           len(tail))
        else:
            f.write(b"\n")


class _LineFile:
    """A file lines are appended to with one write each; a failed write is undone."""

    def __init__(self, path: Path) -> None:
        self.path = path
        repair_last_line(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, text: str) -> None:
        data = text.encode("utf-8")
        start = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(data):
                written += os.write(self.fd, data[written:])
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass  # left torn: repaired when the file is opened again
            free = shutil.disk_usage(self.path.parent).free
            raise LogWriteError(f"cannot write {self.path}: {e.strerror} ({free / 2**20:.1f} MiB free); "
                                f"free space and run the same command again to resume from the last "
                                f"checkpoint") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class JsonlLogger:
    """Appends ``{"step": step, **metrics}`` lines to ``metrics.jsonl`` under `output_dir`."""

    def __init__(self, output_dir: str | Path, **_: Any) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._metrics = _LineFile(self.path)
        self._samples: _LineFile | None = None
        self._rollouts: _LineFile | None = None

    @staticmethod
    def _line(record: dict) -> str:
        return json.dumps({k: _strict(v) for k, v in record.items()}, ensure_ascii=False, default=str) + "\n"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._metrics.append(self._line({"step": step, **{k: v for k, v in metrics.items() if k != "step"}}))

    def log_samples(self, samples: list[dict], step: int) -> None:
        if self._samples is None:
            self._samples = _LineFile(self.dir / "samples.jsonl")
        self._samples.append("".join(self._line({"step": step, **sample}) for sample in samples))

    def log_rollouts(self, records: list[dict], step: int) -> None:
        if self._rollouts is None:
            self._rollouts = _LineFile(self.dir / "rollouts.jsonl")
        self._rollouts.append("".join(self._line({"step": step, **record}) for record in records))

    def close(self) -> None:
        self._metrics.close()
        for extra in (self._samples, self._rollouts):
            if extra is not None:
                extra.close()
