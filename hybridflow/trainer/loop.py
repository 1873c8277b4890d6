"""The step loop every trainer shares: validate first, train to `total_steps`, validate and checkpoint
on schedule, log each step, and stop cleanly (after a checkpoint) on SIGINT/SIGTERM.

A trainer passed in (a `hybridflow.trainer.base.Trainer`) has `cfg.trainer` (val_before_train, val_every,
save_every), `step`, `total_steps`, `train_loader`, `val_loader` (or None), `tracker`, `checkpoints` (with
`save()`) and the methods `train_step(batch) -> metrics` and `validate() -> metrics`.
"""

from __future__ import annotations

from typing import Any

from hybridflow.checkpoint import GracefulStop
from hybridflow.tracking import ProgressBar


def run_steps(trainer: Any) -> dict[str, float]:
    """Runs the loop from `trainer.step` to `trainer.total_steps`; returns the last step's metrics."""
    t, cfg, metrics = trainer, trainer.cfg.trainer, {}
    if t.val_loader is not None and cfg.val_before_train and t.step == 0:
        t.tracker.log(t.validate(), t.step)
    with GracefulStop() as stop, ProgressBar(t.total_steps, initial=t.step) as bar:
        while t.step < t.total_steps:
            metrics = t.train_step(t.train_loader.next_batch())
            t.step += 1
            last = t.step == t.total_steps
            if t.val_loader is not None and cfg.val_every and (t.step % cfg.val_every == 0 or last):
                metrics.update(t.validate())
            t.tracker.log(metrics, t.step)
            bar.update(t.step, metrics)
            if last or stop.requested or (cfg.save_every and t.step % cfg.save_every == 0):
                t.checkpoints.save()
            if stop.requested:
                print(f"stopped by {stop.signal_name} after step {t.step}; checkpoint saved")
                break
    return metrics
