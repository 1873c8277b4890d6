"""`EngineDriver` overlaps the episodes' host work with the GPU's: while a step's kernels run (its CUDA event not
yet done), the event loop runs other coroutines, whose turns join the next step; the finished rows are read only
after the event, and the next step is launched then without waiting for the event loop. A session double stands
for the engine: its step's "GPU" finishes only once the loop has run a coroutine, so a driver that blocked the
loop while waiting would never get there."""

from __future__ import annotations

import asyncio
import threading
import time

from hybridflow.agents.loop.engine_driver import EngineDriver
from hybridflow.engine.rollout import Completion
from hybridflow.engine.rollout.session import Launched


class GPUWork:
    """A CUDA event's stand-in: `synchronize` blocks until the test releases it (from the event loop)."""

    def __init__(self) -> None:
        self.finished = threading.Event()

    def synchronize(self) -> None:
        assert self.finished.wait(timeout=10), "the GPU work was never released: the event loop was blocked"


class TwoStepSession:
    """Sequence 0 runs one step; a sequence added meanwhile runs in the next. Records the order of events."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.queued: list[int] = [0]
        self.running: list[int] = []
        self.work: GPUWork | None = None

    def add(self, prompt: list[int], n: int, max_tokens: int) -> list[int]:
        self.log.append("add")
        self.queued.append(1)
        return [1]

    def launch(self) -> Launched | None:
        if not self.queued:
            return None
        self.running, self.queued = self.queued, []
        self.log.append(f"launch {self.running}")
        self.work = GPUWork()
        return Launched(0.0, 0.0, False, self.work)

    def collect(self, launched: Launched) -> list[tuple[int, Completion]]:
        assert launched.done is self.work and self.work.finished.is_set(), "rows read before the GPU was done"
        self.log.append(f"collect {self.running}")
        return [(seq, Completion([7], [-0.5], "stop")) for seq in self.running]


async def first_step_running(session: TwoStepSession):
    """The driver serving `session` with sequence 0's step launched, and sequence 1 queued beside it: (driver, its
    serve task, sequence 0's future, sequence 1's)."""
    driver = EngineDriver(session)
    first = driver._future(0)
    serving = asyncio.create_task(driver.serve())
    while session.work is None:  # the first step is launched
        await asyncio.sleep(0)
    (_, second), = driver.start([1, 2], 1, 4)
    return driver, serving, first, second


def test_episodes_run_while_the_gpu_works_and_their_turns_join_the_next_step():
    session = TwoStepSession()

    async def main() -> list[str]:
        # the loop runs while the step's kernels do: an episode queues a turn, then the "GPU" finishes
        driver, serving, first, second = await first_step_running(session)
        session.work.finished.set()
        assert (await first).token_ids == [7]
        while session.log[-1] != "launch [1]":
            await asyncio.sleep(0)
        session.work.finished.set()
        assert (await second).finish_reason == "stop"
        driver.stop()
        await serving
        return session.log

    log = asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert log == ["launch [0]", "add", "collect [0]", "launch [1]", "collect [1]"]


def test_the_next_step_launches_while_the_event_loop_is_busy():
    """A request handler holding the event loop (rendering a long conversation) when a step ends does not keep
    the GPU waiting: the worker thread that saw the step end reads its rows and launches the queued turn."""
    session = TwoStepSession()

    async def main() -> list[str]:
        driver, serving, first, second = await first_step_running(session)
        session.log.append("handler starts")
        session.work.finished.set()
        deadline = time.monotonic() + 10
        while session.log[-1] != "launch [1]" and time.monotonic() < deadline:
            time.sleep(0.001)  # the handler's work: the event loop runs nothing else meanwhile
        session.log.append("handler ends")
        assert (await first).token_ids == [7]
        session.work.finished.set()
        await second
        driver.stop()
        await serving
        return session.log

    log = asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert log == ["launch [0]", "add", "handler starts", "collect [0]", "launch [1]", "handler ends", "collect [1]"]


def test_a_real_session_serves_concurrent_episodes_from_the_worker_thread(tiny_qwen2, monkeypatch):
    """The GPU path on a CPU engine: each step's `Launched` carries a finished event, so the worker thread collects
    it and launches the next step while the episodes extend, shorten and release their sequences from the event
    loop. Every turn completes, within its token cap, with finite log-probs."""
    from endpoint_helpers import launch_as_on_a_gpu
    from hybridflow.engine.rollout import RolloutEngine, SamplingParams

    launch_as_on_a_gpu(monkeypatch)
    engine = RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=4, max_model_len=96)
    threads: set[str] = set()

    async def episode(driver: EngineDriver, seq: int, first: asyncio.Future) -> list[int]:
        completion = await first
        lengths = [len(completion.token_ids)]
        for turn in range(2):
            if turn == 1 and len(completion.token_ids) > 1:
                driver.shorten(seq, 1, completion.token_ids[-2])
            completion = await driver.extend(seq, [5, 6, 7], 6)
            assert all(lp <= 0 for lp in completion.logprobs)
            lengths.append(len(completion.token_ids))
        driver.release(seq)
        return lengths

    async def main() -> list[list[int]]:
        driver = EngineDriver(engine.session(SamplingParams(temperature=1.0, max_tokens=6, seed=0), hold=True))
        turn_over = driver._turn_over

        def in_thread(*args):
            threads.add(threading.current_thread().name)
            return turn_over(*args)

        driver._turn_over = in_thread
        serving = asyncio.create_task(driver.serve())
        episodes = [episode(driver, seq, first) for prompt in ([3, 4, 5], [8, 9], [10, 11, 12, 13])
                    for seq, first in driver.start(prompt, 2, 6)]
        lengths = await asyncio.gather(*episodes)
        driver.stop()
        await serving
        return lengths

    lengths = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert len(lengths) == 6 and all(len(turns) == 3 and all(1 <= n <= 6 for n in turns) for turns in lengths)
    assert threads and threading.main_thread().name not in threads


def test_a_cancelled_turn_is_dropped_and_the_others_go_on():
    """A request handler cancelled while its turn runs (its future cancelled) does not stop the driver."""
    session = TwoStepSession()

    async def main() -> list[str]:
        driver, serving, first, second = await first_step_running(session)
        first.cancel()
        session.work.finished.set()
        while session.log[-1] != "launch [1]":
            await asyncio.sleep(0)
        session.work.finished.set()
        assert (await second).token_ids == [7]
        driver.stop()
        await serving
        return session.log

    log = asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert log[-1] == "collect [1]"
