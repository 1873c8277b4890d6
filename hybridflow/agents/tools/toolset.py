"""The tools of a run (`agent.tools`): built-ins and user classes, built once per process, and one call
run with its checks.

Each entry of `agent.tools` is a built-in name (`calculator`, `python`), a `path/to/file.py:Class`, a verl
tool config YAML (its tools, `hybridflow.agents.adapters.verl_tools`), or a mapping with the keys `name`, `class`,
`description`, `parameters`, `kwargs`: `class` is a built-in
name or `file.py:Class` (default: `name`, as a built-in), `kwargs` go to its constructor, and `name`,
`description`, `parameters` (a JSON schema) override the class's. A bad entry is refused when the
run starts, naming `agent.tools[i]`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hybridflow.agents.adapters.verl_tools import is_config_file, load_tool_config
from hybridflow.agents.loop.calls import UserCodeError, call_with_timeout
from hybridflow.agents.tools.calculator import Calculator
from hybridflow.agents.tools.parsing import ToolCall, check_arguments, coerce_arguments
from hybridflow.agents.tools.sandbox import PythonTool
from hybridflow.agents.tools.tool import Scratch, Tool, ToolContext, ToolResult
from hybridflow.utils.imports import load_from_file

logger = logging.getLogger(__name__)

BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": Calculator, "python": PythonTool}
ENTRY_KEYS = ("name", "class", "description", "parameters", "kwargs")


def _tool_class(spec: str, where: str) -> type:
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    if ":" not in spec:
        raise ValueError(f"{where}: {spec!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor a "
                         f"'path/to/file.py:Class'")
    cls = load_from_file(spec, "tool", "class", where)
    if isinstance(cls, type) and callable(getattr(cls, "execute", None)) and not callable(getattr(cls, "call", None)):
        raise TypeError(f"{where}: {spec!r} is a verl BaseTool: list it in a verl tool config YAML "
                        f"(tools: [{{class_name, config, tool_schema}}]) and give that file as the entry")
    if not isinstance(cls, type) or not callable(getattr(cls, "call", None)):
        raise TypeError(f"{where}: {spec!r} must be a class with a call(arguments, context) method "
                        f"(subclass hybridflow.agents.Tool)")
    return cls


def build_tool(entry: Any, index: int) -> Tool:
    """The tool of one `agent.tools` entry (see the module docstring)."""
    where = f"agent.tools[{index}]"
    if isinstance(entry, str):
        entry = {"class": entry}
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a tool name, 'path/to/file.py:Class' or a mapping, got {entry!r:.80}")
    unknown = set(entry) - set(ENTRY_KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; valid: {', '.join(ENTRY_KEYS)}")
    spec = entry.get("class") or entry.get("name")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{where} needs a `class` (a built-in name or 'path/to/file.py:Class') or a built-in `name`")
    kwargs = dict(entry.get("kwargs") or {})
    try:
        tool = _tool_class(spec, where)(**kwargs)
    except TypeError as e:
        raise TypeError(f"{where}: cannot build {spec!r} with kwargs {kwargs}: {e}") from None
    for key in ("name", "description", "parameters"):
        if entry.get(key) is not None:
            setattr(tool, key, entry[key])
    if not isinstance(tool.name, str) or not tool.name:
        raise ValueError(f"{where}: the tool has no name; set `name` in the entry or on the class")
    if not isinstance(tool.parameters, Mapping) or tool.parameters.get("type") != "object":
        raise ValueError(f"{where} ({tool.name}): `parameters` must be a JSON schema of type 'object', got "
                         f"{tool.parameters!r:.80}")
    return tool


class ToolSet:
    """The run's tools by name; `schemas()` for the chat template, `run(call, context)` for one call."""

    def __init__(self, entries: Sequence[Any]) -> None:
        self.tools: dict[str, Tool] = {}
        for i, entry in enumerate(entries):
            built = load_tool_config(entry, f"agent.tools[{i}]") if is_config_file(entry) else [build_tool(entry, i)]
            for tool in built:
                if tool.name in self.tools:
                    raise ValueError(f"agent.tools[{i}]: a second tool named {tool.name!r}; names must be unique")
                self.tools[tool.name] = tool

    def __bool__(self) -> bool:
        return bool(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    def contexts(self, row: Mapping[str, Any], scratch: Scratch) -> dict[str, ToolContext]:
        """One context per tool for a trajectory of `row` (its `extra_info.tools_kwargs[name]` as kwargs)."""
        per_tool = (row.get("extra_info") or {}).get("tools_kwargs") or {}
        return {name: ToolContext(dict(row), dict(per_tool.get(name) or {}), scratch) for name in self.tools}

    async def run(self, call: ToolCall, context: ToolContext | None, timeout_s: float,
                  threads: ThreadPoolExecutor | None = None) -> ToolResult:
        """The result of one parsed call; a malformed call, an unknown tool, bad arguments, an exception
        or a timeout give an error result (its text tells the model what went wrong). context: the called
        tool's (`contexts`); None where the call names no tool of the set, which is answered without one."""
        if call.error is not None:
            return ToolResult(call.error, error=True)
        name = call.name
        tool = self.tools.get(name) if name is not None else None
        if name is None or tool is None:
            return ToolResult(f"Error: there is no tool {name!r}; the tools are {', '.join(self.tools)}",
                              error=True)
        if context is None:
            raise ValueError(f"ToolSet.run: no ToolContext given for the call of tool {name!r}")
        arguments = coerce_arguments(call.arguments, tool.parameters)
        problem = check_arguments(arguments, tool.parameters)
        if problem is not None:
            return ToolResult(f"Error: {call.name}: {problem}", error=True)
        try:
            result = await call_with_timeout(tool.call, arguments, context, timeout_s=timeout_s,
                                             threads=threads)
        except UserCodeError as e:  # a tool's failure is the model's answer, not the run's end
            return ToolResult(f"Error: {call.name} failed: {e}", error=True)
        except TimeoutError as e:
            return ToolResult(f"Error: {call.name} failed: TimeoutError: {e}", error=True)
        return plain_result(result, name)

    async def finish(self, contexts: dict[str, ToolContext], timeout_s: float,
                     threads: ThreadPoolExecutor | None = None) -> float:
        """The end of a trajectory for tools with a `finish(context)` (verl's calc_reward and release): the
        sum of the rewards they return. A failing or hung one is logged and adds nothing."""
        total = 0.0
        for name, tool in self.tools.items():
            finish = getattr(tool, "finish", None)  # optional: not part of the `Tool` protocol
            if callable(finish):
                try:
                    total += float(await call_with_timeout(finish, contexts[name], timeout_s=timeout_s,
                                                           threads=threads) or 0.0)
                except Exception as e:  # noqa: BLE001 - the trajectory is over; its reward stays as it was
                    logger.warning("tool %s finish failed: %s: %s", name, type(e).__name__, e)
        return total


def plain_result(result: Any, name: str) -> ToolResult:
    """What a tool's `call` returned as a `ToolResult` of plain types (a str, or a `ToolResult` whose text is a
    str, reward a number and error a bool); anything else is an error result naming the tool."""
    if isinstance(result, str):
        return ToolResult(str(result))
    if not isinstance(result, ToolResult):
        return ToolResult(f"Error: {name} returned a {type(result).__name__}, not text", error=True)
    if not isinstance(result.text, str):
        return ToolResult(f"Error: {name} returned a ToolResult whose text is a {type(result.text).__name__}, "
                          f"not a str", error=True)
    try:
        reward = float(result.reward)
    except (TypeError, ValueError):
        return ToolResult(f"Error: {name} returned a ToolResult whose reward {result.reward!r:.40} is not a number",
                          error=True)
    return ToolResult(str(result.text), reward, bool(result.error))
