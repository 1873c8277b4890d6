"""Stopping cleanly on SIGINT / SIGTERM: a flag the trainer checks at step boundaries.

    with GracefulStop() as stop:
        for step in ...:
            train_step()
            if stop.requested:
                save_checkpoint()
                raise Preempted(stop.signal_name, step, checkpoint)

The first signal only sets `requested` (and `signal_name`), so the current step finishes and a
checkpoint can be written; a second signal raises `KeyboardInterrupt` at once for a user who really
wants out. Leaving the block puts the previous handlers back. Signal handlers can only be installed
from the main thread; elsewhere `GracefulStop` raises a clear error.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

# `hybridflow train` / `sft` exit with this after a stop by signal that saved a checkpoint: "preempted,
# run the same command again to resume". 75 is EX_TEMPFAIL of sysexits.h (a temporary failure; retry).
PREEMPTED_EXIT_CODE = 75


class Preempted(Exception):
    """A run stopped by SIGINT / SIGTERM after saving the checkpoint of its last finished step."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint} saved; run the "
                         f"same command again (trainer.resume=auto) to continue from it")


class GracefulStop:
    """Context manager turning SIGINT / SIGTERM (or the given `signals`) into a stop request."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)):
        self.signals = signals
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping immediately")
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("GracefulStop must be entered in the main thread (Python delivers "
                               "signals only there)")
        self.requested, self.signal_name = False, None
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __bool__(self) -> bool:
        return self.requested
