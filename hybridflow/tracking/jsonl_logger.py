"""The jsonl logger: ``<output_dir>/metrics.jsonl`` (one object per step) and ``samples.jsonl``.

Files are opened in append mode and flushed after each line, so a crash loses nothing already logged,
old lines are never rewritten, and a resumed run appends after them (readers keep the last line for a
step that appears twice). Non-finite numbers are written as ``null`` so every line is strict JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _strict(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlLogger:
    """Appends ``{"step": step, **metrics}`` lines to ``metrics.jsonl`` under `output_dir`."""

    def __init__(self, output_dir: str | Path, **_: Any) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._metrics = open(self.path, "a", encoding="utf-8")
        self._samples = None

    @staticmethod
    def _line(record: dict) -> str:
        return json.dumps({k: _strict(v) for k, v in record.items()}, ensure_ascii=False, default=str) + "\n"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._metrics.write(self._line({"step": step, **{k: v for k, v in metrics.items() if k != "step"}}))
        self._metrics.flush()

    def log_samples(self, samples: list[dict], step: int) -> None:
        if self._samples is None:
            self._samples = open(self.dir / "samples.jsonl", "a", encoding="utf-8")
        for sample in samples:
            self._samples.write(self._line({"step": step, **sample}))
        self._samples.flush()

    def close(self) -> None:
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()
