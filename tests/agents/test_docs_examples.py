"""docs/agents.md stays true: its environment and tool examples load through the config's spec and do
what the page says."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from hybridflow.agents.environment import as_env_step, load_environment
from hybridflow.agents.parsing import ToolCall
from hybridflow.agents.tools import Scratch, ToolContext
from hybridflow.agents.toolset import ToolSet

PAGE = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def examples() -> dict[str, str]:
    """The python blocks of the page, keyed by the file name in their first comment."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
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
