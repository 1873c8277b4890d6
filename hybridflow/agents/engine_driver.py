"""`EngineDriver`: the rollout engine's session seen from asyncio, so many episodes share one batch.

Episodes (coroutines) ask for turns — `start` a prompt's n samples, `extend` a sequence after an
environment turn — and await futures; `serve()` steps the session whenever it has work (a prefill, or the
few decode steps the engine runs between two host syncs) and resolves each future when that sequence's turn
ends. A sequence whose episode is waiting on a tool or an environment sits in its KV slot outside the running
batch; nothing waits for it. When the session has nothing to run, `serve` sleeps until an episode submits
something.

The episodes' host work runs while the GPU works: `serve` queues a step's kernels (`Session.launch`), waits
for them in a worker thread (a CUDA event), and meanwhile the event loop runs the episodes and the endpoint's
request handlers (rendering, tokenizing, parsing), which queue their turns for the next step. Only then does
it read the finished rows (`Session.collect`), resolve their futures, and launch the next step at once, so the
episodes those rows wake do their work beside that step. On a CPU the step has run by the time `launch`
returns, and the loop yields once between steps.
"""

from __future__ import annotations

import asyncio

from hybridflow.engine.rollout.session import Session


class EngineDriver:
    """Futures over a held `Session` (see the module docstring)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.pending: dict[int, asyncio.Future] = {}
        self.wake = asyncio.Event()
        self.stopped = False

    def _future(self, seq: int) -> asyncio.Future:
        self.pending[seq] = asyncio.get_running_loop().create_future()
        self.wake.set()
        return self.pending[seq]

    def start(self, prompt: list[int], n: int, max_tokens: int) -> list[tuple[int, asyncio.Future]]:
        """Queue a prompt's n samples; their sequence ids and first turns' futures."""
        return [(seq, self._future(seq)) for seq in self.session.add(prompt, n, max_tokens)]

    def extend(self, seq: int, tokens: list[int], max_tokens: int) -> asyncio.Future:
        """Append `tokens` to sequence `seq` and generate its next turn (a future of its `Completion`)."""
        self.session.extend(seq, tokens, max_tokens)
        return self._future(seq)

    def shorten(self, seq: int, drop: int, last_token: int) -> None:
        """Sequence `seq` (between turns) forgets the last `drop` tokens of its turn (`Session.shorten`)."""
        self.session.shorten(seq, drop, last_token)

    def release(self, seq: int) -> None:
        """The episode of `seq` is over: free its slot if it holds one (which may let a waiting prompt in)."""
        if seq in self.session.held:
            self.session.release(seq)
            self.wake.set()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    async def serve(self) -> None:
        """Step the session until `stop`; an engine error fails every waiting future, then is raised."""
        try:
            while not self.stopped:
                launched = self.session.launch()
                if launched is None:  # nothing to run
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                if launched.done is not None:
                    await asyncio.to_thread(launched.done.synchronize)
                for seq, completion in self.session.collect(launched):
                    self.pending.pop(seq).set_result(completion)
                if launched.done is None:
                    await asyncio.sleep(0)
        except Exception as error:
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(error)
            raise
