"""Environments that exit, interrupt, crash their process, hang or flood the output: each costs only the
trajectories it served, the process they run in is replaced, and nothing of theirs outlives the rollout."""

from __future__ import annotations

import os
import threading
import time

import pytest
from transformers import AutoTokenizer

from agent_helpers import agent_cfg
from hybridflow.agents import AgentLoop
from hybridflow.agents.loop import host
from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from test_loop import prompts_for, rows_for

FAULTY = """
    import asyncio, os, sys, time
    from hybridflow.agents import EnvStep

    def fail(fault):
        if fault == "exit":
            sys.exit(3)
        if fault == "interrupt":
            raise KeyboardInterrupt
        if fault == "cancel":
            raise asyncio.CancelledError
        if fault == "os_exit":
            os._exit(0)
        if fault == "hang":
            time.sleep(600)
        if fault == "print":
            print("x" * 10 ** 6)

    class Faulty:
        def __init__(self, row):
            self.fault = row["extra_info"].get("fault")

        def step(self, text, turn):
            fail(self.fault)
            return EnvStep("again")

    class AsyncFaulty(Faulty):
        async def step(self, text, turn):
            if self.fault == "block":  # blocks the host's event loop itself
                time.sleep(30)
            fail(self.fault)
            return EnvStep("again")
"""


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    return RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=8, max_model_len=512)


def run_faults(engine, tiny_qwen2, env_file, cls, faults, **cfg):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    loop = AgentLoop(agent_cfg(environment=f"{env_file(FAULTY)}:{cls}", max_turns=3, max_tokens_per_turn=4, **cfg),
                     tokenizer, budget=120)
    rows = rows_for(len(faults))
    for row, fault in zip(rows, faults):
        row["extra_info"]["fault"] = fault
    start = time.perf_counter()
    outs = loop.run(engine, prompts_for(tokenizer, ["q"] * len(faults)), rows, SamplingParams(seed=0))
    return loop, [(row[0].turns, row[0].env_errors) for row in outs], time.perf_counter() - start


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z")


@pytest.mark.parametrize("cls", ["Faulty", "AsyncFaulty"])
def test_exit_and_interrupt_end_only_their_trajectory(engine, tiny_qwen2, env_file, cls):
    loop, outcomes, _ = run_faults(engine, tiny_qwen2, env_file, cls, [None, "exit", "interrupt", "cancel", None])
    assert outcomes == [(3, 0), (1, 1), (1, 1), (1, 1), (3, 0)]
    pid = loop.host.process.pid  # no call timed out: the same process serves the next rollout
    loop.close()
    assert not alive(pid)


def test_a_dying_host_fails_its_trajectories_and_is_replaced(engine, tiny_qwen2, env_file):
    loop, outcomes, _ = run_faults(engine, tiny_qwen2, env_file, "Faulty", [None, "os_exit", None])
    assert [errors for _, errors in outcomes] == [1, 1, 1]  # the others' environments died with the process
    assert loop.host.lost == {}  # every lost trajectory was closed
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    again = loop.run(engine, prompts_for(tokenizer, ["q", "r"]), rows_for(2), SamplingParams(seed=1))
    assert [(row[0].turns, row[0].env_errors) for row in again] == [(3, 0), (3, 0)]  # a fresh process serves
    loop.close()


def test_a_hung_sync_step_leaves_nothing_behind(engine, tiny_qwen2, env_file):
    # threads an earlier test of this process left on purpose (a worker group's log server lives as long as
    # the process) are not this rollout's: under xdist any module may have run before this one
    earlier = set(threading.enumerate())
    loop, outcomes, seconds = run_faults(engine, tiny_qwen2, env_file, "Faulty", ["hang", None], timeout_s=1.0)
    assert outcomes == [(1, 1), (3, 0)] and seconds < 20
    assert loop.host.process is None  # a call timed out: its process went with the rollout
    assert not [t for t in threading.enumerate() if t.name.startswith("hybridflow") and t not in earlier]
    loop.close()


HUNG = """
    import threading, time
    from hybridflow.agents import EnvStep

    LOCK = threading.Lock()  # a sync environment's close() needs what its hung step() holds

    class Hung:
        def __init__(self, row):
            pass

        def step(self, text, turn):
            with LOCK:
                time.sleep(600)

        def close(self):
            with LOCK:
                pass
"""


def test_after_a_hung_step_close_is_not_waited_on(engine, tiny_qwen2, env_file, capfd):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    loop = AgentLoop(agent_cfg(environment=f"{env_file(HUNG)}:Hung", max_turns=3, max_tokens_per_turn=4,
                               timeout_s=3.0), tokenizer, budget=120)
    start = time.perf_counter()
    outs = loop.run(engine, prompts_for(tokenizer, ["q"] * 4), rows_for(4), SamplingParams(seed=0))
    seconds = time.perf_counter() - start
    loop.close()
    assert [(row[0].turns, row[0].env_errors) for row in outs] == [(1, 1)] * 4
    err = capfd.readouterr().err
    assert "close() failed" not in err  # no second, misleading warning per trajectory
    assert seconds < 2 * 3.0 - 0.5  # the steps' time limit, not the closes' after it as well


def test_a_host_whose_loop_blocks_is_killed(engine, tiny_qwen2, env_file, monkeypatch):
    monkeypatch.setattr(host, "HOST_GRACE_S", 1.0)
    loop, outcomes, seconds = run_faults(engine, tiny_qwen2, env_file, "AsyncFaulty", ["block", None],
                                         timeout_s=0.5)
    assert [errors for _, errors in outcomes] == [1, 1] and seconds < 15
    loop.close()


def test_prints_are_capped_per_call(engine, tiny_qwen2, env_file, capfd):
    loop, outcomes, _ = run_faults(engine, tiny_qwen2, env_file, "Faulty", ["print"])
    loop.close()
    out, err = capfd.readouterr()
    assert outcomes == [(3, 0)]
    note = "[hybridflow: this call printed more than 4096 characters; the rest is dropped]"
    assert out.count(note) == 3  # a step per model turn, the last one included
    assert len(out) < 3 * (4096 + len(note) + 2) + 100


def test_user_code_never_runs_in_the_controller(env_file):
    from hybridflow.agents.loop.host import tool_schemas

    source = "import os\nos._exit(7)\n"  # a module that kills whoever imports it
    with pytest.raises(RuntimeError, match=r"ended \(exit code 7\) while loading them"):
        tool_schemas(agent_cfg(environment=f"{env_file(source)}:Env"))
    tools = env_file("import sys\nsys.exit(5)\n")
    with pytest.raises(ValueError, match=r"agent.tools: SystemExit: 5"):
        tool_schemas(agent_cfg(tools=[f"{tools}:Tool"]))
