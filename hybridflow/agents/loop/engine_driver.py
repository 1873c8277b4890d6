"""`EngineDriver`: the rollout engine's session seen from asyncio, so many episodes share one batch.

Episodes (coroutines) ask for turns — `start` a prompt's n samples, `extend` a sequence after an
environment turn — and await futures; `serve()` steps the session whenever it has work (a prefill, or the
few decode steps the engine runs between two host syncs) and resolves each future when that sequence's turn
ends. A sequence whose episode is waiting on a tool or an environment sits in its KV slot outside the running
batch; nothing waits for it. When the session has nothing to run, `serve` sleeps until an episode submits
something.

The episodes' host work runs while the GPU works: `serve` queues a step's kernels (`Session.launch`), and a
worker thread waits for them (a CUDA event), reads the finished rows (`Session.collect`) and launches the next
step at once, before handing the rows back to the event loop. Meanwhile the event loop runs the episodes and
the endpoint's request handlers (rendering, tokenizing, parsing), which queue their turns for the next launch.
The GPU therefore never waits for the event loop: a step's end is not queued behind the handlers that ran
during it (on the H100 that wait was most of the endpoint's idle engine time against the in-process loop).
The session is touched from both threads, so every call into it holds `lock`. On a CPU the step has run by
the time `launch` returns; the event loop collects it and yields once between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import torch

from hybridflow.engine.rollout.session import Launched, Session
from hybridflow.engine.rollout.types import Completion


class TurnFutures:
    """What a driver's callers wait on: each sequence's current turn is a future in `pending`, resolved when the turn
    ends (`_settle`) or failed with the error that ended `serve` (`_fail`; a turn asked for later fails at once);
    `wake` rouses `serve` when a turn is queued or `stop` is called. `EngineDriver` and the vision engine's
    `VisionDriver` both keep their turns so."""

    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future] = {}
        self.wake = asyncio.Event()
        self.stopped = False
        self.error: Exception | None = None  # what ended `serve`: later turns fail with it instead of waiting
        self.last_step = time.monotonic()  # when a step's rows were last read (the stall watch's clock)

    def _future(self, seq: int) -> asyncio.Future:
        self.pending[seq] = future = asyncio.get_running_loop().create_future()
        if self.error is not None:
            future.set_exception(self.error)
        self.wake.set()
        return future

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    def _settle(self, seq: int, completion: Completion) -> None:
        future = self.pending.pop(seq)
        if not future.cancelled():  # its request's handler was cancelled (the server closing): nobody waits
            future.set_result(completion)

    def _fail(self, error: Exception) -> None:
        self.error = error
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)


class EngineDriver(TurnFutures):
    """Futures over a held `Session` (see the module docstring)."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session
        self.lock = threading.Lock()  # the session's: the event loop and the worker thread both call into it

    @property
    def max_group(self) -> int:
        """The most samples one prompt should ask for: new prompts are admitted once this many KV slots are free
        (`Scheduler.admit_batch`, an eighth of them) and in arrival order, so a larger group would hold every
        prompt behind it back for longer than the engine's own admission does."""
        return self.session.scheduler.admit_batch

    def start(self, prompt: list[int], n: int, max_tokens: int) -> list[tuple[int, asyncio.Future]]:
        """Queue a prompt's n samples; their sequence ids and first turns' futures."""
        with self.lock:
            seqs = self.session.add(prompt, n, max_tokens)
        return [(seq, self._future(seq)) for seq in seqs]

    def extend(self, seq: int, tokens: list[int], max_tokens: int) -> asyncio.Future:
        """Append `tokens` to sequence `seq` and generate its next turn (a future of its `Completion`)."""
        with self.lock:
            self.session.extend(seq, tokens, max_tokens)
        return self._future(seq)

    def shorten(self, seq: int, drop: int, last_token: int) -> None:
        """Sequence `seq` (between turns) forgets the last `drop` tokens of its turn (`Session.shorten`)."""
        with self.lock:
            self.session.shorten(seq, drop, last_token)

    def release(self, seq: int) -> None:
        """The episode of `seq` is over: free its slot if it holds one (which may let a waiting prompt in)."""
        with self.lock:
            if seq not in self.session.held:
                return
            self.session.release(seq)
        self.wake.set()

    def describe(self) -> str:
        """What the session holds, for a message about a stall."""
        with self.lock:
            session = self.session
            return (f"{len(self.pending)} turns waiting, {len(session.running)} sequences in the running batch, "
                    f"{len(session.held)} of {session.engine.kv.num_slots} KV slots held between turns")

    def _resolve(self, finished: list[tuple[int, Completion]]) -> None:
        self.last_step = time.monotonic()
        for seq, completion in finished:
            self._settle(seq, completion)

    def _collect(self, launched: Launched) -> None:
        """On the event loop: read `launched`'s rows and resolve their turns."""
        with self.lock:
            finished = self.session.collect(launched)
        self._resolve(finished)

    def _turn_over(self, launched: Launched, device: int | None) -> tuple[list[tuple[int, Completion]],
                                                                          Launched | None]:
        """In the worker thread: wait for `launched`, read its rows and launch the next step (None: nothing
        queued yet; the event loop looks again once it has run)."""
        assert launched.done is not None
        launched.done.synchronize()
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext(), self.lock:
            return self.session.collect(launched), self.session.launch()

    async def serve(self) -> None:
        """Step the session until `stop`; an engine error fails every waiting future, then is raised. A step
        in flight at `stop` is collected first."""
        # the worker thread launches on the engine's device (a thread starts on device 0); a CPU run never
        # initialises CUDA
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        launched: Launched | None = None
        try:
            while not self.stopped:
                if launched is None:
                    with self.lock:
                        launched = self.session.launch()
                    if launched is None:  # nothing to run
                        self.wake.clear()
                        await self.wake.wait()
                        continue
                if launched.done is None:  # a CPU step: it has run
                    self._collect(launched)
                    launched = None
                    await asyncio.sleep(0)
                    continue
                finished, launched = await asyncio.to_thread(self._turn_over, launched, device)
                self._resolve(finished)
            if launched is not None:  # launched by the worker thread, so a GPU step
                assert launched.done is not None
                await asyncio.to_thread(launched.done.synchronize)
                self._collect(launched)
        except Exception as error:
            self._fail(error)
            raise
