"""The step loop every trainer shares: validate first, train to `total_steps`, validate and checkpoint
on schedule (and at the end), log each step, and stop cleanly on SIGINT/SIGTERM: the step under way finishes, its checkpoint
is saved, and `Preempted` is raised (`hybridflow train` exits with `PREEMPTED_EXIT_CODE`). A worker that
dies stops the run with its error saying which checkpoint to resume from. A run resumed at `total_steps`
says it has nothing to train.

The trainer passed in (a `hybridflow.trainer.base.Trainer`) keeps `SteppedTrainer`: `cfg.trainer`
(val_before_train, val_every, save_every), `validates_at_end` (validate after the last step even with
`val_every=0`), `step`, `total_steps`, `train_loader`, `val_loader` (or None), `tracker`, `checkpoints` (with
`save() -> Path` and `manager`) and the methods `train_step(batch) -> metrics` and `validate() -> metrics`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from hybridflow.batch import Batch
from hybridflow.checkpoint import GracefulStop, Preempted
from hybridflow.controller import WorkerDiedError
from hybridflow.data.loader import BatchLoader
from hybridflow.tracking import ProgressBar, Tracker


class SteppedTrainer(Protocol):
    """What the loop reads and calls on a trainer (`Trainer` keeps it)."""

    cfg: Any
    validates_at_end: bool
    step: int
    total_steps: int
    train_loader: BatchLoader
    val_loader: BatchLoader | None
    tracker: Tracker | None
    checkpoints: Any  # `checkpointing.RunCheckpoints`: save() -> Path, manager

    def train_step(self, batch: Batch) -> dict[str, float]: ...

    def validate(self) -> dict[str, float]: ...


@contextmanager
def _resume_hint(trainer: SteppedTrainer) -> Iterator[None]:
    """A worker (or its node) that died ends the run; its error then says where the run can continue from."""
    try:
        yield
    except WorkerDiedError as exc:
        latest = trainer.checkpoints.manager.latest()
        exc.add_note(f"the run stopped after {trainer.step} completed step(s); " + (
            f"its last complete checkpoint is {latest}: run the same command again (trainer.resume=auto) to "
            f"continue from it" if latest is not None else "it saved no checkpoint yet (trainer.save_every)"))
        raise


def run_steps(trainer: SteppedTrainer) -> dict[str, float]:
    """Runs the loop from `trainer.step` to `trainer.total_steps`; returns the last step's metrics."""
    t, cfg, metrics = trainer, trainer.cfg.trainer, {}
    tracker = t.tracker
    if tracker is None:
        raise RuntimeError("run_steps needs a built trainer (its metric tracker is made last)")
    if t.step >= t.total_steps:
        print(f"the run is already at step {t.step} of {t.total_steps}: nothing to train (raise "
              f"trainer.total_steps to train on)")
        return {}
    with GracefulStop() as stop, ProgressBar(t.total_steps, initial=t.step) as bar, _resume_hint(t):
        if t.val_loader is not None and cfg.val_before_train and t.step == 0:
            tracker.log(t.validate(), t.step)
        while t.step < t.total_steps:
            metrics = t.train_step(t.train_loader.next_batch())
            t.step += 1
            last = t.step == t.total_steps
            periodic = cfg.val_every and (t.step % cfg.val_every == 0 or last)
            if t.val_loader is not None and (periodic or (last and t.validates_at_end)):
                metrics.update(t.validate())
            tracker.log(metrics, t.step)
            bar.update(t.step, metrics)
            saved = None
            if last or stop.requested or (cfg.save_every and t.step % cfg.save_every == 0):
                saved = t.checkpoints.save()
            if stop.requested and not last:
                raise Preempted(str(stop.signal_name), t.step, saved)
    return metrics
