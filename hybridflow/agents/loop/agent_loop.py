"""`AgentLoop`: multi-turn episodes for a batch of prompts, run concurrently on one rollout engine.

    loop = AgentLoop(cfg.agent, tokenizer, budget=cfg.data.max_response_length)
    trajectories = loop.run(engine, prompt_ids, rows, SamplingParams(n=8, temperature=1.0))  # [prompt][sample]
    loop.close()                                              # ends the environments' process

Each episode: the model's turn (the prompt's n samples share one prefill) -> if tools are configured and
the turn calls any, their results as `tool` messages; else the environment's next message; else the
end -> the message's ids appended to the live sequence and the next model turn generated from the
cached KV. It ends when the environment sends nothing or says done, at `agent.max_turns` model turns,
when tool calls pass `agent.max_tool_calls`, or when the token budget (`data.max_response_length`
over all turns, each model turn also capped by `agent.max_tokens_per_turn`) runs out, which counts
as a cut. All episodes run at once on one asyncio loop around the engine's session (`EngineDriver`):
one waiting on a tool leaves the batch and comes back when answered. Environments and tools run in a
process of their own (`UserCodeHost`); their failures (exceptions, `SystemExit`, `agent.timeout_s`, the
process dying) are counted on the trajectory and end it or answer the model; an engine failure fails
the call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Any, Protocol

from hybridflow.agents.loop.calls import UserCodeError
from hybridflow.agents.loop.engine_driver import EngineDriver
from hybridflow.agents.loop.host import UserCodeHost, host_setup
from hybridflow.agents.loop.rendering import TurnRenderer
from hybridflow.agents.loop.trajectory import Trajectory
from hybridflow.agents.tools.parsing import parse_tool_calls
from hybridflow.agents.tools.tool import ToolResult
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


class AgentLoop:
    """Multi-turn episodes per `agent` config (see the module docstring).

    agent_cfg: the `agent` config section; tokenizer: the model's (decodes model turns, renders
    environment turns); budget: response tokens per trajectory over all its turns.
    """

    def __init__(self, agent_cfg: AgentSettings, tokenizer: Any, budget: int) -> None:
        self.cfg, self.tokenizer, self.budget = agent_cfg, tokenizer, budget
        self.host = UserCodeHost(host_setup(agent_cfg))
        self.has_tools = bool(self.host.schemas)
        self.renderer = TurnRenderer(tokenizer, self.host.schemas or None)
        self.turn_tokens = min(agent_cfg.max_tokens_per_turn or budget, budget)
        self._ids = itertools.count()  # trajectory ids, unique for the host's whole life

    def close(self) -> None:
        """Ends the process the environments and tools run in."""
        self.host.close()

    def run(self, engine: Any, prompts: list[list[int]], rows: list[dict[str, Any]],
            params: SamplingParams) -> list[list[Trajectory]]:
        """`params.n` trajectories per prompt (`rows[i]`: prompt i's dataset row); outs[i][j]."""
        check_prompts(prompts, engine.max_model_len, engine.config.vocab_size)
        return asyncio.run(self._run(engine, prompts, rows, params))

    async def _run(self, engine: Any, prompts: list[list[int]], rows: list[dict[str, Any]],
                   params: SamplingParams) -> list[list[Trajectory]]:
        session = engine.session(dataclasses.replace(params, max_tokens=self.turn_tokens), hold=True)
        driver = EngineDriver(session)
        async with self.host.attached():
            serving = asyncio.create_task(driver.serve())
            episodes = [[asyncio.create_task(self._episode(driver, seq, first, row, len(prompt)))
                         for seq, first in driver.start(prompt, params.n, self.turn_tokens)]
                        for prompt, row in zip(prompts, rows)]
            try:
                await asyncio.gather(*(e for per_prompt in episodes for e in per_prompt))
            finally:
                driver.stop()
                await asyncio.gather(serving, return_exceptions=True)  # its error, if any, reached the episodes
        return [[e.result() for e in per_prompt] for per_prompt in episodes]

    async def _episode(self, driver: EngineDriver, seq: int, first: asyncio.Future, row: dict[str, Any],
                       prompt_len: int) -> Trajectory:
        trajectory, tid = Trajectory(), next(self._ids)
        has_env = await self._open(tid, row, trajectory)
        try:
            completion: Completion = await first
            while True:
                text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                trajectory.add_model_turn(completion, text)
                spent = len(trajectory.token_ids) >= self.budget
                messages = await self._respond(text, trajectory, tid, has_env,
                                               last=spent or trajectory.turns >= self.cfg.max_turns)
                if spent:
                    trajectory.cut()
                if not messages:
                    break
                ids = self.renderer.render(messages, completion.token_ids[-1] if completion.finish_reason == "stop"
                                           else None, limit=self.budget - len(trajectory.token_ids))
                room = self.budget - len(trajectory.token_ids) - len(ids)
                if room < 1:
                    trajectory.cut()
                    break
                trajectory.add_env_turn(ids, messages)
                trajectory.kv_reused_tokens += prompt_len + len(trajectory.token_ids) - len(ids) - 1
                completion = await driver.extend(seq, ids, min(self.turn_tokens, room))
        finally:
            driver.release(seq)
            try:  # the tools' end-of-trajectory rewards (verl's calc_reward), the environment's close()
                trajectory.env_reward += await self.host.call("close", tid)
            except Exception:  # noqa: BLE001 - its process died (said once, when it did): nothing to add
                pass
        return trajectory

    async def _open(self, tid: int, row: dict[str, Any], trajectory: Trajectory) -> bool:
        """Makes the trajectory's tool contexts and environment in the host; whether it has an environment
        (not without one, nor when making it failed: counted)."""
        try:
            await self.host.call("open", tid, (dict(row), dict(self.cfg.env_kwargs)))
        except Exception as e:  # noqa: BLE001 - a broken environment ends its trajectory, not the run
            trajectory.env_failed(f"making the environment failed: {_failure(e)}")
            logger.warning("making the environment %s failed: %s", self.cfg.environment, _failure(e))
            return False
        return bool(self.cfg.environment)

    async def _respond(self, text: str, trajectory: Trajectory, tid: int, has_env: bool,
                       last: bool) -> list[dict[str, str]]:
        """The messages answering a model turn: tool results when it calls tools, else the environment's
        message; [] ends the episode. On the `last` turn (turn or token limit reached) no tool runs and
        the environment's step only adds its reward."""
        start = time.perf_counter()
        try:
            calls = parse_tool_calls(text) if self.has_tools and not last else []
            if calls:
                return await self._call_tools(calls, trajectory, tid)
            if not has_env:
                return []
            try:
                step = await self.host.call("step", tid, (text, trajectory.turns - 1))
            except Exception as e:  # noqa: BLE001 - ends this trajectory, counted
                trajectory.env_failed(f"step() failed: {_failure(e)}")
                logger.warning("environment %s step() failed: %s", self.cfg.environment, _failure(e))
                return []
            trajectory.env_reward += step.reward
            if step.message is None or step.done or last:
                return []
            return [{"role": step.role, "content": step.message}]
        finally:
            trajectory.env_seconds += time.perf_counter() - start

    async def _call_tools(self, calls: list, trajectory: Trajectory, tid: int) -> list[dict[str, str]]:
        """The calls' results as tool messages ([] past `agent.max_tool_calls`, or when the host died: the
        trajectory's tool state is gone, it ends with its calls counted as errors)."""
        left = self.cfg.max_tool_calls - trajectory.tool_calls
        if left <= 0:
            return []
        results = await asyncio.gather(*(self.host.call("tool", tid, call) for call in calls[:left]),
                                       return_exceptions=True)
        trajectory.tool_calls += len(results)
        died = [r for r in results if isinstance(r, BaseException)]
        if died:
            trajectory.tool_errors += len(results)
            logger.warning("tool calls failed: %s", died[0])
            return []
        answers: list[ToolResult] = [r for r in results if not isinstance(r, BaseException)]  # all of them
        trajectory.tool_errors += sum(r.error for r in answers)
        trajectory.env_reward += sum(r.reward for r in answers)
        answers += [ToolResult(f"Error: this episode's limit of {self.cfg.max_tool_calls} tool calls is reached",
                               error=True) for _ in calls[left:]]
        return [{"role": "tool", "content": r.text} for r in answers]


def _failure(error: Exception) -> str:
    """A failed call as `Type: message` (a `UserCodeError` already reads so)."""
    return str(error) if isinstance(error, UserCodeError) else f"{type(error).__name__}: {error}"
