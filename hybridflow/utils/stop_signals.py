"""Stopping on SIGINT / SIGTERM: a flag the trainer checks at step boundaries, and at once outside them.

    with StopAtOnce():                      # the whole command (`hybridflow train` / `sft`)
        start_the_run()                     # a signal here raises `Interrupted`: the `finally` blocks stop
        with GracefulStop() as stop:        # the workers, nothing of a step is lost (there is none)
            for step in ...:
                train_step()
                if stop.requested:
                    save_checkpoint()
                    raise Preempted(stop.signal_name, step, checkpoint)

Inside `GracefulStop` the first signal only sets `requested` (and `signal_name`), so the current step
finishes and a checkpoint can be written; a second signal raises `Interrupted` at once for a user who
really wants out. Outside it (loading models, starting workers, the last save's aftermath) `StopAtOnce`
raises `Interrupted` on the first signal. Either way a copy of the signal just handled, by either block,
arriving within `DUPLICATE_WINDOW_S`, is one signal: a wrapper such as `timeout --foreground` forwards the
Ctrl-C its process group already got, so the run sees every Ctrl-C twice (the copy may reach `StopAtOnce`
after `GracefulStop` saved and left: the stop stays the clean one). Leaving a block puts the previous
handlers back. Signal handlers can only be installed from the main thread; elsewhere both raise a
clear error.

    with held_signals():                    # around starting a process: a signal arriving meanwhile
        process.start()                     # is handled when the block ends
    ignore_stop_signals()                   # first thing in that process

A child whose start is cut short (its parent stopped between starting it and handing it its work)
would print a traceback of its own, and so would a child that a Ctrl-C to the process group reaches
while Python is still starting in it. `held_signals` closes both windows, in the main thread: the stop
handlers' answer to a signal caught in the block waits for the block's end, and the two signals are blocked
in the main thread while it runs, so the child starts with them blocked (a blocked mask survives fork, exec
and Python's start: a signal meanwhile waits in it, CPython's resource tracker starts so too);
`ignore_stop_signals` then ignores them, which drops one waiting, and unblocks them. The controller loses
none: its handlers stay in place (another thread takes the signal, or it waits until the block unblocks it).
Ignoring them in the controller instead lost one that arrived while a child started: the run trained on.
Processes the run starts ignore SIGINT and SIGTERM: a terminal, Slurm or systemd send them to every
process of the run; the controller gets them too and coordinates the stop (it finishes the step and
saves), then shuts the processes down.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from types import FrameType

# `hybridflow train` / `sft` exit with this after a stop by signal that saved a checkpoint: "preempted,
# run the same command again to resume". 75 is EX_TEMPFAIL of sysexits.h (a temporary failure; retry).
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DUPLICATE_WINDOW_S = 0.5  # a forwarded copy arrives within milliseconds; a person's second Ctrl-C later
_held: list | None = None  # inside `held_signals`: the (handler, signal number) pairs that arrived
# the last signal any handler took (signal number, when): a copy may reach the next handler, e.g. `StopAtOnce` once
# `GracefulStop`'s block ended by saving and raising `Preempted`, and must not turn that clean stop into `Interrupted`
_last: tuple[int, float] | None = None


class Preempted(Exception):
    """A run stopped by SIGINT / SIGTERM after saving the checkpoint of its last finished step."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint} saved; run the "
                         f"same command again (trainer.resume=auto) to continue from it")


class Interrupted(KeyboardInterrupt):
    """A run stopped at once by a signal: a second one during a step (`second`), or one outside the steps.
    `exit_code` is 128 + the signal's number, as a shell reports a process that signal ended."""

    def __init__(self, signum: int, second: bool) -> None:
        self.signal_name, self.second = signal.Signals(signum).name, second
        self.exit_code = 128 + signum
        super().__init__(f"second {self.signal_name}: stopping immediately" if second else
                         f"{self.signal_name} outside a training step: stopping immediately")


def interruption(error: BaseException) -> Interrupted | None:
    """The `Interrupted` that `error` was raised while unwinding (through `__cause__` and `__context__`), or None: a
    signal's stop can land inside a library's context managers, whose cleanup then fails on its half-made state
    (transformers' loading contexts over torch's mode stack: "trying to pop from empty mode stack"), and that error,
    wrapped on its way out (a worker's start), would hide the stop."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, Interrupted):
            return current
        seen.add(id(current))
        current = current.__cause__ if current.__cause__ is not None else current.__context__
    return None


class _Handler:
    """Installs `_handle` for `signals` while the block runs; tells a copy of the last signal from a new one."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self._previous: dict[signal.Signals, signal._HANDLER] = {}

    @staticmethod
    def _is_copy(signum: int) -> bool:
        global _last
        now, last = time.monotonic(), _last
        _last = (signum, now)
        return last is not None and last[0] == signum and now - last[1] < DUPLICATE_WINDOW_S

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if _held is not None:
            _held.append((self, signum))
        else:
            self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        raise NotImplementedError

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"{type(self).__name__} must be entered in the main thread (Python delivers "
                               f"signals only there)")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class StopAtOnce(_Handler):
    """Context manager: SIGINT / SIGTERM (or the given `signals`) raise `Interrupted` at once."""

    def _on_signal(self, signum: int) -> None:
        if not self._is_copy(signum):
            raise Interrupted(signum, second=False)


class GracefulStop(_Handler):
    """Context manager turning SIGINT / SIGTERM (or the given `signals`) into a stop request."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        super().__init__(signals)
        self.requested = False
        self.signal_name: str | None = None

    def _on_signal(self, signum: int) -> None:
        if self._is_copy(signum):
            return
        if self.requested:
            raise Interrupted(signum, second=True)
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> GracefulStop:
        self.requested, self.signal_name = False, None
        return super().__enter__()

    def __bool__(self) -> bool:
        return self.requested


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Around starting a process (see the module docstring): SIGINT and SIGTERM blocked in the main thread, so the
    child starts with them blocked, and the stop handlers' answer to one caught in the block deferred to its end.
    Nested blocks wait for the outermost; outside the main thread (where handlers do not run) nothing is held."""
    global _held
    if _held is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    # multiprocessing's resource tracker, on its first start, blocks these signals around its spawn and then
    # unblocks them: started here first, it cannot unblock them inside the block
    resource_tracker.ensure_running()
    _held = []
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one waiting runs its handler here, into `_held`
        held, _held = _held, None
        for handler, signum in held:
            handler._on_signal(signum)


def ignore_stop_signals() -> None:
    """In a process the run started (a worker, a reward or environment process): ignore SIGINT and SIGTERM (see the
    module docstring), then unblock them, as `held_signals` left them blocked: one that waited is dropped."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
