"""Reading a run directory back: its metrics per step, its logged samples and its config.

A run directory is the `trainer.output_dir` of a `hybridflow train` run:

    metrics.jsonl                      one JSON object per logged step (the `jsonl` logger)
    samples.jsonl                      sample completions logged at each validation
    checkpoints/step_<N>/config.yaml   the resolved config, in every complete checkpoint

A step logged twice (a resumed run appends after its old lines) keeps its last line, as
docs/tracking.md says readers should. A line that is not JSON (a crash mid-write) is skipped and
reported, never fatal: a report of a broken run is when it is most needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIG_FILE = "config.yaml"


class ReportError(ValueError):
    """A run directory the report cannot be made from (missing, or without metrics.jsonl)."""


@dataclass
class RunLog:
    """What a run wrote, keyed by step.

    `metrics[step]` is that step's metrics (numbers; non-finite ones logged as null are dropped);
    `samples` are the rows of samples.jsonl in file order (each with `step`, `prompt`, `response`,
    `reward`, `data_source`); `config` is the resolved config (None when not recorded) and
    `config_source` the file it came from; `unreadable` names the skipped lines ("metrics.jsonl:7").
    """

    run_dir: Path
    metrics: dict[int, dict[str, float]]
    samples: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    config_source: Path | None = None
    unreadable: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return sorted(self.metrics)

    def keys(self) -> set[str]:
        """Every metric name that has at least one value."""
        return {k for row in self.metrics.values() for k in row}

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """`(steps, values)` of one metric, over the steps that logged it."""
        steps = [s for s in self.steps if key in self.metrics[s]]
        return steps, [self.metrics[s][key] for s in steps]


def _read_jsonl(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """`(line number, object)` for the JSON-object lines of `path`, and the names (`file:line`) of the
    lines that are not JSON objects."""
    rows, bad = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append((number, row))
        else:
            bad.append(f"{path.name}:{number}")
    return rows, bad


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _metrics_by_step(rows: list[tuple[int, dict[str, Any]]], path: Path
                     ) -> tuple[dict[int, dict[str, float]], list[str]]:
    """Numeric metrics per step (the last line of a step wins) and the lines without an integer step."""
    by_step: dict[int, dict[str, float]] = {}
    bad = []
    for number, row in rows:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            bad.append(f"{path.name}:{number} (no integer 'step')")
            continue
        by_step[step] = {k: v for k, v in ((k, _number(v)) for k, v in row.items() if k != "step") if v is not None}
    return by_step, bad


def find_config(run_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The run's resolved config and its file: the newest complete checkpoint's `config.yaml`, else a
    `config.yaml` at the top of the run directory, else `(None, None)`."""
    from hybridflow.checkpoint.manager import CheckpointError, find_checkpoint

    candidates = []
    try:
        candidates.append(find_checkpoint(run_dir, checksums=False) / CONFIG_FILE)
    except CheckpointError:
        pass
    candidates.append(run_dir / CONFIG_FILE)
    for path in candidates:
        if path.is_file():
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
            return (loaded if isinstance(loaded, dict) else {"config": loaded}), path
    return None, None


def load_run(run_dir: str | Path) -> RunLog:
    """Reads `run_dir` (a run's `trainer.output_dir`); `ReportError` when it has no metrics.jsonl."""
    root = Path(run_dir).expanduser()
    if not root.is_dir():
        raise ReportError(f"run directory {root} does not exist (pass a run's trainer.output_dir)")
    metrics_path = root / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{root} has no metrics.jsonl; the report reads the jsonl logger's file, so the run "
                          f"needs 'jsonl' in trainer.loggers (the default is [console, jsonl])")
    rows, unreadable = _read_jsonl(metrics_path)
    metrics, no_step = _metrics_by_step(rows, metrics_path)
    samples: list[dict[str, Any]] = []
    if (root / "samples.jsonl").is_file():
        sample_rows, bad_samples = _read_jsonl(root / "samples.jsonl")
        samples = [row for _, row in sample_rows]
        unreadable += bad_samples
    config, source = find_config(root)
    return RunLog(root, metrics, samples, config, source, unreadable + no_step)
