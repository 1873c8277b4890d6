"""docs/agents.md and docs/agents_from_verl_and_trl.md stay true: their environment and tool examples load
through the config's spec and do what the page says; their agent code runs against the endpoint (a scripted
model answering) and earns the reward the page implies, in one token sequence."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from endpoint_helpers import ScriptedDriver, client, serving
from hybridflow.agents.endpoint.runner_child import load_runner
from hybridflow.agents.loop.environment import as_env_step, load_environment
from hybridflow.agents.tools.parsing import ToolCall
from hybridflow.agents.tools.tool import Scratch, ToolContext
from hybridflow.agents.tools.toolset import ToolSet
from hybridflow.engine.rollout import SamplingParams
from hybridflow.utils.tiny_model import build_tokenizer

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "agents.md"


def examples(page: Path = PAGE) -> dict[str, str]:
    """The python blocks of the page, keyed by the file name in their first comment."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    return {m.group(1): block for block in blocks if (m := re.match(r"# (\w+\.py)", block))}


def test_the_pages_environment_and_tool_work(tmp_path):
    found = examples()
    assert {"my_env.py", "my_tools.py"} <= set(found)
    for name, source in found.items():
        (tmp_path / name).write_text(source)
    env_class = load_environment(f"{tmp_path}/my_env.py:Feedback")
    env = env_class({"ground_truth": "42"}, hint="Look again.")
    assert as_env_step(env.step("I think 41", 0), "step").message == "Look again."
    final = as_env_step(env.step("It is 42.", 1), "step")
    assert final.message is None and final.reward == 1.0
    tools = ToolSet(["calculator", f"{tmp_path}/my_tools.py:Weather"])
    result = asyncio.run(tools.run(ToolCall("weather", {"city": "Oslo"}), ToolContext({}, {}, Scratch()), 5.0))
    assert result.text == "Sunny in Oslo" and not result.error


def play(spec: str, row: dict, answers: list[str], **kwargs):
    """(reward, trajectory) of the runner `spec` against the endpoint, a scripted model writing `answers`."""
    tokenizer = build_tokenizer()
    driver = ScriptedDriver(tokenizer, answers, tokenizer.eos_token_id)
    runner = load_runner(spec)

    async def main():
        async with serving(tokenizer, driver, SamplingParams(max_tokens=64), budget=400, max_prompt_length=2000) as (
                endpoint, port):
            lane = endpoint.open("doc")
            reward = await runner(client(port, "doc"), row, **kwargs)
            lane.end(driver.release)  # the runner returned
            return reward, lane.finish(endpoint.renderers)

    return asyncio.run(main())


def test_the_pages_agent_code_runs_against_the_endpoint(tmp_path):
    found = {**examples(), **examples(DOCS / "agents_from_verl_and_trl.md")}
    assert {"my_agent.py", "my_game.py", "tool_agent.py", "trl_env.py"} <= set(found)
    for name, source in found.items():
        (tmp_path / name).write_text(source)
    row = {"raw_prompt": [{"role": "user", "content": "What is 6 * 7?"}], "ground_truth": "42"}
    reward, trajectory = play(f"{tmp_path}/my_agent.py:play", row, ["It is 41.", "It is 42."])
    assert reward == {"reward": 1.0, "metrics": {"tries": 2}} and trajectory.turns == 2
    assert trajectory.segments == 1 and trajectory.token_mismatch == 0
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    reward, trajectory = play(f"{tmp_path}/tool_agent.py:run", {**row, "ground_truth": "5"},
                              [call.format("add", '{"a": 2, "b": 3}'), "The sum is 5."])
    assert reward == 1.0 and trajectory.turns == 2 and trajectory.segments == 1
    reward, trajectory = play(f"{tmp_path}/trl_env.py:run", row, [call.format("increment", '{"step": 5}'), "Done."])
    assert reward == 1.0 and trajectory.turns == 2 and trajectory.segments == 1
    count = load_environment(f"{tmp_path}/my_game.py:Count")(target=2)
    assert count.reset(seed=1)[0].startswith("Count to 2") and count.step("1")[1:3] == (1.0, False)
