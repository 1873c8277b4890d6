"""Tracking: the loggers a run writes to, the progress bar, and the standard metric helpers.

- `Tracker(loggers, output_dir, ...)`: ``console``, ``jsonl`` (``metrics.jsonl``), ``tensorboard``, ``wandb``.
- `ProgressBar`: tqdm over steps with ETA and the last reward.
- `compute_data_metrics`, `compute_timing_metrics`, `compute_throughput`, `compute_validation_metrics`,
  `timer`: a step's metrics from its batch and timings.
"""

from hybridflow.tracking.console_logger import format_line
from hybridflow.tracking.metrics import (
    compute_data_metrics,
    compute_throughput,
    compute_timing_metrics,
    compute_validation_metrics,
    timer,
)
from hybridflow.tracking.progress import ProgressBar
from hybridflow.tracking.tracker import LOGGERS, Tracker, config_dict

__all__ = [
    "LOGGERS",
    "ProgressBar",
    "Tracker",
    "compute_data_metrics",
    "compute_throughput",
    "compute_timing_metrics",
    "compute_validation_metrics",
    "config_dict",
    "format_line",
    "timer",
]
