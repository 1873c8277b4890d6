"""`EndpointRollout` with runners in their own process: rewards and metrics come back per trajectory, and a
runner that raises, hangs past agent.timeout_s, returns a non-reward, returns while its request runs or
sends one after it returned, or takes its process down, costs only its trajectory (counted, dropped)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from transformers import AutoTokenizer

from agent_helpers import agent_cfg
from hybridflow.agents.endpoint.endpoint_rollout import EndpointRollout
from hybridflow.agents.endpoint.runner_host import RunnerFailed, RunnerHost
from hybridflow.engine.rollout import RolloutEngine, SamplingParams

RUNNERS = """
    import asyncio, os

    async def ask(client, text, **kwargs):
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": text}],
                                                     **kwargs)
        return reply.choices[0].message.content

    async def play(client, row, bonus=0.0):
        case = row["extra_info"]["case"]
        if case == "good":
            text = await ask(client, "Hello", max_tokens=4)
            return {"reward": 1.0 + bonus, "metrics": {"chars": len(text)}}
        if case == "raises":
            await ask(client, "Hello")
            raise ValueError("the agent broke")
        if case == "hangs":
            await asyncio.sleep(60)
        if case == "not a reward":
            return "great"
        if case == "in flight":
            asyncio.ensure_future(ask(client, "Hello"))
            await asyncio.sleep(0)
            return 1.0
        if case == "late":
            async def later():
                await asyncio.sleep(0.5)
                await ask(client, "Hello")
            asyncio.ensure_future(later())
            return 1.0
        if case == "exits":
            os._exit(3)
        if case == "slow":
            await ask(client, "Hello", max_tokens=2)
            await asyncio.sleep(1.5)
            return 1.0
        if case == "many":
            await ask(client, "Hello", n=10000)
        if case == "pid":
            await ask(client, "Hello", max_tokens=2)
            return {"reward": 1.0, "metrics": {"pid": os.getpid()}}
"""


@pytest.fixture(scope="module")
def setup(tiny_qwen2):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    return tokenizer, RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=8, max_model_len=256)


def rows(*cases):
    return [{"index": i, "raw_prompt": "q", "extra_info": {"case": case}} for i, case in enumerate(cases)]


def test_runner_failures_cost_only_their_trajectory(setup, env_file):
    tokenizer, engine = setup
    spec = f"{env_file(RUNNERS)}:play"
    rollout = EndpointRollout(agent_cfg(timeout_s=3, max_tokens_per_turn=8, runner_processes=1), tokenizer,
                              budget=32, max_prompt_length=64, runner=spec, kwargs={"bonus": 0.5})
    cases = ("good", "raises", "hangs", "not a reward", "in flight", "late")
    start = time.monotonic()
    outs = rollout.run(engine, [[1]] * len(cases), rows(*cases), SamplingParams(n=2, temperature=1.0, seed=0))
    assert time.monotonic() - start < 30
    by_case = dict(zip(cases, outs))
    for good in by_case["good"]:
        assert good.dropped is None and good.env_reward == 1.5 and good.runner_errors == 0
        assert 0 <= good.metrics["chars"] and good.turns == 1 and 1 <= len(good.token_ids) <= 4
    reasons = {case: {t.dropped for t in per_row} for case, per_row in by_case.items() if case != "good"}
    assert reasons["raises"] == {"the runner failed: ValueError: the agent broke"}
    assert reasons["hangs"] == {"the runner failed: no request and no return within agent.timeout_s=3 s"}
    assert all("return a finite number" in r for r in reasons["not a reward"])
    # a request still on its way when the runner returned is refused, or its answer abandoned: dropped either way
    assert reasons["in flight"] <= {"the runner failed: it returned while one of its requests was still running",
                                    "a request came after its runner returned"}
    assert all(t.runner_errors + t.late_requests == 1 for t in by_case["in flight"])
    assert reasons["late"] == {"a request came after its runner returned"}
    assert all(t.late_requests == 1 and t.runner_errors == 0 for t in by_case["late"])
    assert all(t.runner_errors == 1 for case in ("raises", "hangs", "not a reward")
               for t in by_case[case])
    assert rollout.hosts[0].proc is None  # killed after a timeout: a hung runner may not honour a cancel

    # the next phase starts a new runner process; one whose runner takes it down fails its trajectories only
    outs = rollout.run(engine, [[1]] * 2, rows("good", "exits"), SamplingParams(n=1, temperature=1.0, seed=1))
    assert "agent runner process ended" in outs[1][0].dropped
    assert outs[1][0].runner_errors == 1
    outs = rollout.run(engine, [[1]], rows("good"), SamplingParams(n=1, temperature=1.0, seed=2))
    assert outs[0][0].dropped is None and outs[0][0].env_reward == 1.5


def test_more_trajectories_than_kv_slots_finish(setup, env_file):
    """Sixteen trajectories on the engine's eight KV slots: a trajectory holds its slot between requests, and
    gives it back when its runner returns, so the ones still waiting for a slot get one (before, they waited
    for it until the phase's end, which never came)."""
    tokenizer, engine = setup
    rollout = EndpointRollout(agent_cfg(timeout_s=5, max_tokens_per_turn=4, runner_processes=1), tokenizer,
                              budget=32, max_prompt_length=64, runner=f"{env_file(RUNNERS)}:play", kwargs={})
    assert engine.kv.num_slots == 8
    start = time.monotonic()
    outs = rollout.run(engine, [[1]] * 8, rows(*["good"] * 8), SamplingParams(n=2, temperature=1.0, seed=0))
    assert time.monotonic() - start < 60
    assert all(t.dropped is None and t.env_reward == 1.0 and t.turns == 1 for row in outs for t in row)
    rollout.close()


def test_an_engine_error_fails_the_phase_with_its_own_message(setup, env_file, monkeypatch):
    """The engine failing mid-phase (out of memory, say) fails the rollout with that error, rather than answering
    every waiting request 500 and dropping the trajectories as runner failures."""
    from hybridflow.engine.rollout.session import Session

    def out_of_memory(self, launched):
        raise RuntimeError("CUDA out of memory (a test's)")

    tokenizer, engine = setup
    rollout = EndpointRollout(agent_cfg(timeout_s=5, max_tokens_per_turn=4, runner_processes=1), tokenizer,
                              budget=32, max_prompt_length=64, runner=f"{env_file(RUNNERS)}:play", kwargs={})
    monkeypatch.setattr(Session, "collect", out_of_memory)
    with pytest.raises(RuntimeError, match=r"CUDA out of memory \(a test's\)"):
        rollout.run(engine, [[1]] * 2, rows("good", "good"), SamplingParams(n=1, temperature=1.0, seed=0))
    monkeypatch.undo()
    outs = rollout.run(engine, [[1]], rows("good"), SamplingParams(n=1, temperature=1.0, seed=1))
    assert outs[0][0].dropped is None  # the next phase runs
    rollout.close()


def test_a_trajectory_is_checked_when_its_runner_returns(setup, env_file, monkeypatch):
    """The token-exact check of a trajectory whose runner returned runs then, while the engine serves the others,
    not after the phase (when the engine is idle)."""
    from hybridflow.agents.endpoint import stitching

    checked, check = [], stitching.first_mismatch
    monkeypatch.setattr(stitching, "first_mismatch",
                        lambda *a, **k: checked.append(time.monotonic()) or check(*a, **k))
    tokenizer, engine = setup
    rollout = EndpointRollout(agent_cfg(timeout_s=5, max_tokens_per_turn=4, runner_processes=1), tokenizer,
                              budget=32, max_prompt_length=64, runner=f"{env_file(RUNNERS)}:play", kwargs={})
    outs = rollout.run(engine, [[1]] * 2, rows("good", "slow"), SamplingParams(n=1, temperature=1.0, seed=0))
    ended = time.monotonic()
    assert all(t.dropped is None for row in outs for t in row)
    assert len(checked) == 2 and checked[0] < ended - 1.0  # the quick one's, while the slow runner slept
    rollout.close()


def test_an_engine_that_stops_stepping_is_reported_once(setup, env_file, monkeypatch, caplog):
    """Requests waiting on an engine that runs no step for agent.timeout_s: a warning says what the session holds
    and the stall is counted, once; when the engine steps again the phase finishes."""
    from hybridflow.agents.loop.engine_driver import EngineDriver
    from hybridflow.engine.rollout.session import Session

    launch, describe, stalled = Session.launch, EngineDriver.describe, [True]

    def reported(self):  # the stall ends once the watch has seen it
        stalled[0] = False
        self.wake.set()
        return describe(self)

    monkeypatch.setattr(Session, "launch", lambda self: None if stalled[0] else launch(self))
    monkeypatch.setattr(EngineDriver, "describe", reported)
    tokenizer, engine = setup
    rollout = EndpointRollout(agent_cfg(timeout_s=1, max_tokens_per_turn=4, runner_processes=1), tokenizer,
                              budget=32, max_prompt_length=64, runner=f"{env_file(RUNNERS)}:play", kwargs={})
    with caplog.at_level(logging.WARNING, logger="hybridflow.agents.endpoint.endpoint_rollout"):
        outs = rollout.run(engine, [[1]] * 2, rows("good", "good"), SamplingParams(n=1, temperature=1.0, seed=0))
    assert all(t.dropped is None and t.env_reward == 1.0 for row in outs for t in row)
    assert rollout.stats["engine_stalls"] == 1
    warnings = [r.getMessage() for r in caplog.records if "has run no step" in r.getMessage()]
    assert len(warnings) == 1
    assert "(agent.timeout_s=1) while" in warnings[0] and "turns waiting" in warnings[0]
    assert "of 8 KV slots held between turns" in warnings[0]
    rollout.close()


def test_runners_asking_for_more_samples_than_the_engine_serves_fail_their_trajectories_only(setup, env_file):
    """Every runner asks for n=10000 on eight KV slots: each request is refused 400 (n above an eighth of the
    slots), so each runner raises and its trajectory counts as a runner error; the phase itself completes."""
    tokenizer, engine = setup
    rollout = EndpointRollout(agent_cfg(timeout_s=10, max_tokens_per_turn=4, runner_processes=1), tokenizer,
                              budget=32, max_prompt_length=64, runner=f"{env_file(RUNNERS)}:play", kwargs={})
    outs = rollout.run(engine, [[1]] * 2, rows("many", "many"), SamplingParams(n=2, temperature=1.0, seed=0))
    trajectories = [t for per_row in outs for t in per_row]
    assert all(t.runner_errors == 1 and "BadRequestError: Error code: 400" in t.dropped and "n <= 1" in t.dropped
               for t in trajectories)
    assert rollout.stats["errors"] == rollout.stats["requests"] == 4


def test_a_batch_whose_every_trajectory_failed_ends_the_run_in_one_line():
    """What a run whose runners all fail (n=10000 above) meets: `hybridflow train` prints a `RowsFailed` as one
    line and exits 2, no traceback."""
    import numpy as np
    import torch

    from hybridflow.batch import Batch
    from hybridflow.rewards.failures import RowsFailed
    from hybridflow.trainer.step_math import drop_failed_trajectories

    reason = "the runner failed: BadRequestError: Error code: 400"
    batch = Batch({"responses": torch.zeros(2, 3)}, {"agent/dropped": np.array([reason, reason], dtype=object)})
    with pytest.raises(RowsFailed, match="every trajectory of this batch failed, the first because the runner"):
        drop_failed_trajectories(batch)


def test_the_endpoint_without_aiohttp_is_refused_naming_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "aiohttp"
                        else find_spec(name, *args))
    with pytest.raises(RuntimeError, match=r"served by aiohttp: pip install 'hybridflow\[agents\]'"):
        EndpointRollout(agent_cfg(), None, budget=32, max_prompt_length=64, runner="x.py:play", kwargs={})


def test_trajectories_are_dealt_over_the_runner_processes_and_a_hang_kills_only_its_own(setup, env_file):
    """agent.runner_processes=2: consecutive trajectories run in two processes; a runner that outlives
    agent.timeout_s takes down its own process after the phase, and the other one serves the next phase."""
    tokenizer, engine = setup
    rollout = EndpointRollout(agent_cfg(timeout_s=2, max_tokens_per_turn=8, runner_processes=2), tokenizer,
                              budget=32, max_prompt_length=64, runner=f"{env_file(RUNNERS)}:play", kwargs={})
    outs = rollout.run(engine, [[1]] * 3, rows("pid", "pid", "hangs"), SamplingParams(n=1, temperature=1.0, seed=0))
    first, second = (int(out[0].metrics["pid"]) for out in outs[:2])
    assert first != second
    assert "agent.timeout_s=2 s" in outs[2][0].dropped
    assert rollout.hosts[0].proc is None and rollout.hosts[1].proc.pid == second  # the hang was dealt to process 0
    outs = rollout.run(engine, [[1]] * 2, rows("pid", "pid"), SamplingParams(n=1, temperature=1.0, seed=1))
    assert int(outs[1][0].metrics["pid"]) == second and int(outs[0][0].metrics["pid"]) not in (first, second)


def test_jobs_given_to_a_runner_process_that_died_fail_instead_of_raising(env_file):
    """A child that died before its loop noticed: the job sent to it and every later one (and a cancel) fail their
    trajectory's future with `RunnerFailed`; none raises out of the phase."""
    host = RunnerHost(f"{env_file(RUNNERS)}:play", {})

    async def after_death():
        await host.attach()
        host.proc.kill()
        host.proc.wait()
        futures = [host.submit(job, {"extra_info": {"case": "good"}}, "http://127.0.0.1:9/v1", "key")
                   for job in ("a", "b")]
        host.cancel("a")
        return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 30)

    try:
        errors = asyncio.run(after_death())
    finally:
        host.kill()
    assert [type(e) for e in errors] == [RunnerFailed, RunnerFailed]
    assert all("the agent runner process ended" in str(e) for e in errors)
    assert host.proc is None and host.conn is None and not host.jobs


def test_runner_kwargs_from_a_config_that_is_not_a_mapping_are_refused():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from hybridflow.agents.episodes import runner_of

    cfg = SimpleNamespace(env_kwargs=OmegaConf.create({"level": 2}), runner="agent.py:play")
    assert runner_of(cfg) == ("agent.py:play", {"level": 2})
    cfg.env_kwargs = OmegaConf.create([{"level": 2}])
    with pytest.raises(TypeError, match="agent.env_kwargs must be a mapping of keyword arguments, got a list"):
        runner_of(cfg)

def test_a_runner_that_cannot_load_is_named(setup, env_file):
    tokenizer, engine = setup
    path = env_file("raise ImportError('no such agent library')")
    spec = f"{path}:play"
    rollout = EndpointRollout(agent_cfg(), tokenizer, budget=32, max_prompt_length=64, runner=spec, kwargs={})
    with pytest.raises(RuntimeError, match="cannot be loaded: ImportError: no such agent library"):
        rollout.run(engine, [[1]], rows("good"), SamplingParams(n=1))


def test_runners_talk_over_aiohttp_where_installed_else_httpx():
    import types

    import openai

    from hybridflow.agents.endpoint.runner_child import http_client

    assert type(http_client(openai)).__name__ == type(openai.DefaultAioHttpClient()).__name__ != \
        type(openai.DefaultAsyncHttpxClient()).__name__

    def missing(**kwargs):
        raise RuntimeError("To use the aiohttp client you must have installed the package with the `aiohttp` extra")

    without = types.SimpleNamespace(DefaultAioHttpClient=missing, DefaultAsyncHttpxClient=openai.DefaultAsyncHttpxClient)
    assert isinstance(http_client(without), type(openai.DefaultAsyncHttpxClient()))


def test_a_proxy_in_the_environment_does_not_catch_the_runners_requests(setup, env_file, monkeypatch):
    # the endpoint is always on 127.0.0.1: a cluster's HTTP(S)_PROXY without a NO_PROXY for it must not matter
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(key, "http://127.0.0.1:9")  # the discard port: nothing answers there
    for key in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(key, raising=False)
    tokenizer, engine = setup
    rollout = EndpointRollout(agent_cfg(timeout_s=20, max_tokens_per_turn=4, runner_processes=1), tokenizer,
                              budget=32, max_prompt_length=64, runner=f"{env_file(RUNNERS)}:play", kwargs={})
    outs = rollout.run(engine, [[1]], rows("good"), SamplingParams(n=1, temperature=1.0, seed=0))
    assert outs[0][0].dropped is None and outs[0][0].env_reward == 1.0
