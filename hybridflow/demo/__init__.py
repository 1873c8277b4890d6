"""The embedded demo (`hybridflow demo`, `make demo`): procedural tasks and the SFT → GRPO pipeline."""

from hybridflow.demo.pipeline import SIZES, DemoSize, run_demo
from hybridflow.demo.tasks import TASKS, make_splits, write_task_data

__all__ = ["SIZES", "TASKS", "DemoSize", "make_splits", "run_demo", "write_task_data"]
