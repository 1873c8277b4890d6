"""`EndpointRollout`: a rollout phase where agent runners drive the model through the OpenAI-compatible
endpoint, with the same interface as `AgentLoop` (`run(engine, prompts, rows, params)` -> trajectories).

    rollout = EndpointRollout(cfg.agent, tokenizer, budget=1024, max_prompt_length=512)
    trajectories = rollout.run(engine, prompt_ids, rows, SamplingParams(n=8, temperature=1.0))  # [prompt][sample]

One phase: a held session on the engine (`EngineDriver`; a vision-language model's engine through `VisionDriver`,
which re-prefills each turn, its requests' images read by `image_parts`), the endpoint serving it on a free port of
127.0.0.1 with a new random token, and one runner call per trajectory (each row's n samples are n calls),
each given its own base URL. The calls are dealt round-robin over `agent.runner_processes` child processes
(`RunnerHost` each): an OpenAI client spends milliseconds of CPU on every request (its request building and
its connection pool's bookkeeping, which grows with the open connections), so one process running a
thousand trajectories would keep the engine waiting.

The runner's reward becomes the trajectory's environment reward (`reward.function=environment` trains on
it). Failures are the trajectory's, never the run's: a runner that raises, returns something else than a
reward, dies with its process, spends more than `agent.timeout_s` between two of its requests (or before
the first, or after the last) or returns while one of its requests is still running is counted
(`agent/runner_errors`) and its trajectory dropped (`Trajectory.drop`: the trainer leaves it out); a
request after the runner returned is refused, counted (`agent/late_requests`) and drops it too. A runner
that outlived its time limit takes its process down after the phase (a blocked one may not honour a
cancel); the other processes serve on.

A phase whose engine runs no step for `agent.timeout_s` while requests wait on it logs a warning with what the
session holds, once per stall, and counts it (`stats["engine_stalls"]`): a trajectory in a tool holds its KV
slot at most that long, so a longer wait is a hang to report, not a slow phase.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from hybridflow.agents.endpoint.image_parts import RequestImages
from hybridflow.agents.endpoint.routes import Endpoint
from hybridflow.agents.endpoint.runner_host import RunnerFailed, RunnerHost
from hybridflow.agents.endpoint.stitching import Lane, Renderers
from hybridflow.agents.endpoint.vision_driver import VisionDriver
from hybridflow.agents.loop.engine_driver import EngineDriver
from hybridflow.agents.loop.trajectory import Trajectory
from hybridflow.data.image_prompts import VisionPrompts
from hybridflow.engine.rollout import SamplingParams

logger = logging.getLogger(__name__)


class EndpointRollout:
    """Runner-driven trajectories over the endpoint (see the module docstring). runner: the runner spec
    (`agent.runner`, or a built-in adapter's `package.module:fn`); kwargs: its keyword arguments; images: a
    vision-language model's tokenizer and image processor (its engine is then a `VisionRolloutEngine`)."""

    def __init__(self, agent_cfg: Any, tokenizer: Any, budget: int, max_prompt_length: int, runner: str,
                 kwargs: dict[str, Any], images: VisionPrompts | None = None) -> None:
        if importlib.util.find_spec("aiohttp") is None:
            raise RuntimeError("the OpenAI-compatible endpoint (agent.runner, agent.verifiers, agent.gym, "
                               "agent.openenv) is served by aiohttp: pip install 'hybridflow[agents]'")
        self.cfg, self.tokenizer, self.budget, self.max_prompt_length = agent_cfg, tokenizer, budget, max_prompt_length
        self.images = images
        self.turn_tokens = min(agent_cfg.max_tokens_per_turn or budget, budget)
        processes = agent_cfg.runner_processes or min(16, os.cpu_count() or 1)
        self.hosts = [RunnerHost(runner, kwargs) for _ in range(processes)]
        self.stats: dict[str, float] = {}
        self.stalls = 0

    def close(self) -> None:
        """Ends the runner processes (the next `run` starts new ones)."""
        for host in self.hosts:
            host.kill()

    def run(self, engine: Any, prompts: list[list[int]], rows: list[dict[str, Any]],
            params: SamplingParams) -> list[list[Trajectory]]:
        """`params.n` trajectories per row (`prompts` are not used: the runners write their own); outs[i][j]."""
        return asyncio.run(self._run(engine, rows, params))

    async def _run(self, engine: Any, rows: list[dict[str, Any]], params: SamplingParams) -> list[list[Trajectory]]:
        from hybridflow.agents.endpoint.http_server import JSONServer  # aiohttp: imported where the endpoint runs only

        session_params = dataclasses.replace(params, n=1, max_tokens=self.turn_tokens)
        driver: EngineDriver | VisionDriver
        if self.images is not None:
            driver, vocab_size = VisionDriver(engine, session_params), engine.vocab_size
        else:
            driver, vocab_size = EngineDriver(engine.session(session_params, hold=True)), engine.config.vocab_size
        serving = asyncio.create_task(driver.serve())
        endpoint = Endpoint(self.tokenizer, driver, session_params, self.budget, self.max_prompt_length, vocab_size,
                            self.cfg.max_concurrent_requests, secrets.token_urlsafe(24),
                            RequestImages(self.images) if self.images is not None else None)
        server = JSONServer(endpoint.handle)
        port = await server.start()
        lanes = [[endpoint.open(secrets.token_urlsafe(12)) for _ in range(params.n)] for _ in rows]
        timed_out: set[RunnerHost] = set()
        try:
            await asyncio.gather(*(host.attach() for host in self.hosts))
            jobs: dict[asyncio.Future, tuple[Lane, RunnerHost]] = {}
            for row, per_row in zip(rows, lanes):
                for lane in per_row:
                    host = self.hosts[len(jobs) % len(self.hosts)]
                    lane.last_activity = time.monotonic()  # the runner's clock starts when it is handed over
                    jobs[host.submit(lane.key, row, f"http://127.0.0.1:{port}/t/{lane.key}/v1",
                                     endpoint.token)] = lane, host
            timed_out = await self._wait(jobs, driver, endpoint.renderers)
        finally:
            for lane in endpoint.lanes.values():
                lane.ended = True
            for host in self.hosts:
                host.detach()
            for host in timed_out:
                host.kill()
            driver.stop()
            engine_error = (await asyncio.gather(serving, return_exceptions=True))[0]
            await server.close()
        try:
            if isinstance(engine_error, Exception):  # the requests it failed were answered 500 and their runners
                raise engine_error  # counted as failed: the phase fails on the engine's own error instead
            self.stats = dict(endpoint.stats, engine_stalls=self.stalls)
            for lane in endpoint.lanes.values():
                lane.release(driver.release)

            def finish_all() -> list[list[Trajectory]]:
                return [[lane.finish(endpoint.renderers) for lane in per_row] for per_row in lanes]

            return await endpoint.renderers.call(finish_all)
        finally:
            endpoint.close()

    async def _wait(self, jobs: dict[asyncio.Future, tuple[Lane, RunnerHost]], driver: EngineDriver | VisionDriver,
                    renderers: Renderers) -> set[RunnerHost]:
        """Until every runner (future -> its trajectory's lane and process) has returned or failed; the processes
        of those that outlived their time limit. A lane whose runner ends frees its KV slots (`Lane.end` with
        the driver's `release`), so trajectories beyond the engine's slots get theirs, and one whose runner
        returned is finished at once (`Lane.finish`: its token check runs while the engine serves the others,
        not after the phase with the engine idle). Watches for a stall."""
        limit, timed_out, release = self.cfg.timeout_s, set(), driver.release
        waiting, self.stalls, reported = set(jobs), 0, None
        checks: list[asyncio.Future] = []
        while waiting:
            done, waiting = await asyncio.wait(waiting, timeout=min(1.0, limit / 4),
                                               return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                lane = jobs[future][0]
                if self._returned(lane, future, release) and lane.pending is not None:  # else at the end: a
                    # request it sent as it returned may still come, to be refused; its slots are free (`end`)
                    checks.append(asyncio.ensure_future(renderers.call(lane.finish, renderers)))
            now = time.monotonic()
            requests = sum(jobs[future][0].in_flight for future in waiting)
            if requests and now - driver.last_step > limit and reported != driver.last_step:
                reported, self.stalls = driver.last_step, self.stalls + 1
                logger.warning("the endpoint's engine has run no step for %.0f s (agent.timeout_s=%g) while %d "
                               "requests wait on it: %s. A hang: please report it with this line",
                               now - driver.last_step, limit, requests, driver.describe())
            for future in list(waiting):
                lane, host = jobs[future]
                if lane.in_flight == 0 and now - lane.last_activity > limit:
                    self._failed(lane, f"no request and no return within agent.timeout_s={limit:g} s", release)
                    host.cancel(lane.key)
                    waiting.discard(future)
                    timed_out.add(host)
        await asyncio.gather(*checks)
        return timed_out

    def _returned(self, lane: Lane, future: asyncio.Future, release: Callable[[int], None]) -> bool:
        """Whether the runner returned a reward with none of its requests running (else it failed)."""
        if future.cancelled():
            return self._failed(lane, "cancelled", release)
        error = future.exception()
        if error is not None:
            return self._failed(lane, str(error) if isinstance(error, RunnerFailed) else repr(error), release)
        lane.end(release)
        if lane.in_flight:
            return self._failed(lane, "it returned while one of its requests was still running", release)
        lane.trajectory.env_reward, lane.trajectory.metrics = future.result()
        return True

    @staticmethod
    def _failed(lane: Lane, why: str, release: Callable[[int], None]) -> bool:
        lane.end(release)
        lane.trajectory.runner_errors += 1
        lane.trajectory.drop(f"the runner failed: {why}")
        logger.warning("agent runner of trajectory %s failed: %s", lane.key, why)
        return False
