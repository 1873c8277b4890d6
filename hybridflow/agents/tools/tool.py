"""The tool protocol: what a tool declares (name, description, JSON-schema parameters) and implements.

    class Weather(Tool):                         # agent.tools=[path/to/file.py:Weather]
        name = "weather"
        description = "Today's weather in a city."
        parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

        def __init__(self, units="metric"):      # the config entry's kwargs; one instance per process
            self.units = units

        async def call(self, arguments, context):  # or a plain def; -> str or ToolResult
            return ToolResult(f"Sunny in {arguments['city']}", reward=0.0)

`call` gets arguments already checked against `parameters` and a `ToolContext` for the trajectory: its
dataset row, this tool's entry of the row's `extra_info.tools_kwargs` (verl's field), a scratch
directory of its own (made on first use, deleted when the trajectory ends) and a state dict that lives
as long as the trajectory. What it returns becomes a `tool` message; `reward` adds to the
trajectory's environment reward; an exception, a timeout or `error=True` counts as a tool error.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolResult:
    """text: the tool message's content; reward: added to the trajectory's environment reward;
    error: the call failed (counted in `agent/tool_errors`)."""

    text: str
    reward: float = 0.0
    error: bool = False


class Scratch:
    """One trajectory's scratch directory, made on first use (under `root`, default the system's temporary
    directory) and deleted by `cleanup`."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root
        self._path: str | None = None

    @property
    def path(self) -> str:
        if self._path is None:
            self._path = tempfile.mkdtemp(prefix="hybridflow-tool-", dir=self.root)
        return self._path

    def cleanup(self) -> None:
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None


@dataclass
class ToolContext:
    """What a call knows of its trajectory (see the module docstring)."""

    row: dict[str, Any]
    kwargs: dict[str, Any]
    scratch: Scratch
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def scratch_dir(self) -> str:
        return self.scratch.path


class Tool:
    """Base class of a tool (see the module docstring). The config may override name, description and
    parameters per entry."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def call(self, arguments: dict[str, Any], context: ToolContext) -> str | ToolResult | Awaitable[str | ToolResult]:
        raise NotImplementedError(f"tool {self.name!r} ({type(self).__name__}) does not implement call()")

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render for `tools=`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}
