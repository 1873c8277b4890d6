"""`AgentLoop`: multi-turn episodes for a batch of prompts, run concurrently on one rollout engine.

    loop = AgentLoop(cfg.agent, tokenizer, budget=cfg.data.max_response_length)
    trajectories = loop.run(engine, prompt_ids, rows, SamplingParams(n=8, temperature=1.0))  # [prompt][sample]

Each episode: the model's turn (the prompt's n samples share one prefill) -> if tools are configured and
the turn calls any, their results as `tool` messages; else the environment's next message; else the
end -> the message's ids appended to the live sequence and the next model turn generated from the
cached KV. It ends when the environment sends nothing or says done, at `agent.max_turns` model turns,
when tool calls pass `agent.max_tool_calls`, or when the token budget (`data.max_response_length`
over all turns, each model turn also capped by `agent.max_tokens_per_turn`) runs out, which counts
as a cut. All episodes run at once on one asyncio loop around the engine's session (`EngineDriver`):
one waiting on a tool leaves the batch and comes back when answered. Environment and tool failures
(exceptions, `agent.timeout_s`) are counted on the trajectory and end it or answer the model; an
engine failure fails the call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from hybridflow.agents.calls import call_with_timeout
from hybridflow.agents.engine_driver import EngineDriver
from hybridflow.agents.environment import as_env_step, environment_kwargs, load_environment
from hybridflow.agents.parsing import parse_tool_calls
from hybridflow.agents.rendering import TurnRenderer
from hybridflow.agents.tools import Scratch, ToolContext, ToolResult
from hybridflow.agents.toolset import ToolSet
from hybridflow.agents.trajectory import Trajectory
from hybridflow.engine.rollout import Completion, SamplingParams
from hybridflow.engine.rollout.types import check_prompts


class AgentSettings(Protocol):
    """What the loop reads of its config: the `agent` section (`hybridflow.config.schema.AgentConfig`), stated
    here since this package imports the engine and data layers alone."""

    environment: str | None
    env_kwargs: dict[str, Any]
    tools: list[Any]
    max_turns: int
    max_tool_calls: int
    max_tokens_per_turn: int | None
    timeout_s: float


logger = logging.getLogger(__name__)

ENV_THREADS = 32  # sync environment steps and tool calls in flight at once


class AgentLoop:
    """Multi-turn episodes per `agent` config (see the module docstring).

    agent_cfg: the `agent` config section; tokenizer: the model's (decodes model turns, renders
    environment turns); budget: response tokens per trajectory over all its turns.
    """

    def __init__(self, agent_cfg: AgentSettings, tokenizer: Any, budget: int) -> None:
        self.cfg, self.tokenizer, self.budget = agent_cfg, tokenizer, budget
        self.tools = ToolSet(agent_cfg.tools)
        self.env_class = load_environment(agent_cfg.environment) if agent_cfg.environment else None
        self.renderer = TurnRenderer(tokenizer, self.tools.schemas() or None)
        self.turn_tokens = min(agent_cfg.max_tokens_per_turn or budget, budget)

    def run(self, engine: Any, prompts: list[list[int]], rows: list[dict[str, Any]],
            params: SamplingParams) -> list[list[Trajectory]]:
        """`params.n` trajectories per prompt (`rows[i]`: prompt i's dataset row); outs[i][j]."""
        check_prompts(prompts, engine.max_model_len, engine.config.vocab_size)
        threads = ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="hybridflow-env")
        try:
            return asyncio.run(self._run(engine, prompts, rows, params, threads))
        finally:
            threads.shutdown(wait=False, cancel_futures=True)  # a hung sync environment keeps its thread

    async def _run(self, engine: Any, prompts: list[list[int]], rows: list[dict[str, Any]], params: SamplingParams,
                   threads: ThreadPoolExecutor) -> list[list[Trajectory]]:
        session = engine.session(dataclasses.replace(params, max_tokens=self.turn_tokens), hold=True)
        driver = EngineDriver(session)
        serving = asyncio.create_task(driver.serve())
        episodes = [[asyncio.create_task(self._episode(driver, seq, first, row, len(prompt), threads))
                     for seq, first in driver.start(prompt, params.n, self.turn_tokens)]
                    for prompt, row in zip(prompts, rows)]
        try:
            await asyncio.gather(*(e for per_prompt in episodes for e in per_prompt))
        finally:
            driver.stop()
            await asyncio.gather(serving, return_exceptions=True)  # its error, if any, reached the episodes
        return [[e.result() for e in per_prompt] for per_prompt in episodes]

    async def _episode(self, driver: EngineDriver, seq: int, first: asyncio.Future, row: dict[str, Any],
                       prompt_len: int, threads: ThreadPoolExecutor) -> Trajectory:
        trajectory, scratch = Trajectory(), Scratch()
        contexts = self.tools.contexts(row, scratch)
        env = await self._make_env(row, trajectory, threads)
        try:
            completion: Completion = await first
            while True:
                text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                trajectory.add_model_turn(completion, text)
                spent = len(trajectory.token_ids) >= self.budget
                messages = await self._respond(text, trajectory, env, contexts, threads,
                                               last=spent or trajectory.turns >= self.cfg.max_turns)
                if spent:
                    trajectory.cut()
                if not messages:
                    break
                ids = self.renderer.render(messages, completion.token_ids[-1] if completion.finish_reason == "stop"
                                           else None)
                room = self.budget - len(trajectory.token_ids) - len(ids)
                if room < 1:
                    trajectory.cut()
                    break
                trajectory.add_env_turn(ids, messages)
                trajectory.kv_reused_tokens += prompt_len + len(trajectory.token_ids) - len(ids) - 1
                completion = await driver.extend(seq, ids, min(self.turn_tokens, room))
        finally:
            driver.release(seq)
            trajectory.env_reward += await self.tools.finish(contexts, self.cfg.timeout_s, threads)
            scratch.cleanup()
            if env is not None and callable(getattr(env, "close", None)):
                try:
                    await call_with_timeout(env.close, timeout_s=self.cfg.timeout_s, threads=threads)
                except Exception as e:  # noqa: BLE001 - the episode is over; a failing close only warns
                    logger.warning("environment close() failed: %s: %s", type(e).__name__, e)
        return trajectory

    async def _make_env(self, row: dict[str, Any], trajectory: Trajectory, threads: ThreadPoolExecutor) -> Any:
        """This trajectory's environment (None without one, or when making it failed: counted)."""
        if self.env_class is None:
            return None
        kwargs = environment_kwargs(self.env_class, self.cfg.env_kwargs, row)
        try:
            return await call_with_timeout(functools.partial(self.env_class, dict(row), **kwargs),
                                           timeout_s=self.cfg.timeout_s, threads=threads)
        except Exception as e:  # noqa: BLE001 - a broken environment ends its trajectory, not the run
            trajectory.env_failed(f"making the environment failed: {type(e).__name__}: {e}")
            logger.warning("making the environment %s failed: %s: %s", self.cfg.environment, type(e).__name__, e)
            return None

    async def _respond(self, text: str, trajectory: Trajectory, env: Any, contexts: dict[str, ToolContext],
                       threads: ThreadPoolExecutor, last: bool) -> list[dict[str, str]]:
        """The messages answering a model turn: tool results when it calls tools, else the environment's
        message; [] ends the episode. On the `last` turn (turn or token limit reached) no tool runs and
        the environment's step only adds its reward."""
        start = time.perf_counter()
        try:
            calls = parse_tool_calls(text) if self.tools and not last else []
            if calls:
                return await self._call_tools(calls, trajectory, contexts, threads)
            if env is None:
                return []
            try:
                step = as_env_step(await call_with_timeout(env.step, text, trajectory.turns - 1,
                                                           timeout_s=self.cfg.timeout_s, threads=threads),
                                   f"{self.cfg.environment} step()")
            except Exception as e:  # noqa: BLE001 - ends this trajectory, counted
                trajectory.env_failed(f"step() failed: {type(e).__name__}: {e}")
                logger.warning("environment %s step() failed: %s: %s", self.cfg.environment, type(e).__name__, e)
                return []
            trajectory.env_reward += step.reward
            if step.message is None or step.done or last:
                return []
            return [{"role": step.role, "content": step.message}]
        finally:
            trajectory.env_seconds += time.perf_counter() - start

    async def _call_tools(self, calls: list, trajectory: Trajectory, contexts: dict[str, ToolContext],
                          threads: ThreadPoolExecutor) -> list[dict[str, str]]:
        left = self.cfg.max_tool_calls - trajectory.tool_calls
        if left <= 0:
            return []
        results = list(await asyncio.gather(*(self.tools.run(call, contexts.get(call.name), self.cfg.timeout_s,
                                                             threads) for call in calls[:left])))
        trajectory.tool_calls += len(results)
        trajectory.tool_errors += sum(r.error for r in results)
        trajectory.env_reward += sum(r.reward for r in results)
        results += [ToolResult(f"Error: this episode's limit of {self.cfg.max_tool_calls} tool calls is reached",
                               error=True) for _ in calls[left:]]
        return [{"role": "tool", "content": r.text} for r in results]
