"""verl's tools, unchanged: a verl tool config YAML as an `agent.tools` entry, its `BaseTool` subclasses called
with their own method names.

    # tools/gsm8k_tool_config.yaml            agent.tools=[tools/gsm8k_tool_config.yaml]
    tools:
      - class_name: my_tools.Gsm8kTool        # dotted (importable, or a .py file beside the YAML) or file.py:Class
        config: {type: native}
        tool_schema: {type: function, function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}}

Each entry is built once per process as ``cls(config=config, tool_schema=schema)`` (the schema as verl's
pydantic `OpenAIFunctionToolSchema` when verl is installed, else an object with the same attribute access and
``model_dump()``). In a trajectory, the first call ``create``s an instance (with the row's
``extra_info.tools_kwargs[name].create_kwargs``), every call ``execute``s with the parsed arguments (a JSON
string for an ``execute`` that annotates its parameters ``str``) and the row's ``execute_kwargs``; of what it
returns, verl's ``(response, reward, metrics)`` or a response alone (reward 0), the response (a string,
``{"text": ...}`` or an object with ``.text``, as verl's ``ToolResponse``) is the tool message and the reward
adds to the environment reward; any other shape is a tool error naming the class. When the trajectory ends,
``calc_reward`` (its value adds to the environment reward too) and ``release`` run with their ``*_kwargs``.
Only ``type: native`` tools load; MCP tools are refused naming the entry, and so is an entry without its
``tool_schema``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridflow.agents.tools.tool import Tool, ToolContext, ToolResult
from hybridflow.utils.imports import load_from_file

CONFIG_SUFFIXES = (".yaml", ".yml")


def is_config_file(entry: Any) -> bool:
    """An `agent.tools` entry (or `agent.environment`) naming a verl config YAML."""
    return isinstance(entry, str) and ":" not in entry and entry.endswith(CONFIG_SUFFIXES)


def read_config(path: str, key: str, where: str) -> list[dict[str, Any]]:
    """The list under `key` of a verl config YAML (``tools`` or ``interaction``), each entry a mapping."""
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise FileNotFoundError(f"{where}: verl config {path} does not exist")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    entries = data.get(key) if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get("class_name") for e in entries):
        raise ValueError(f"{where}: {path} must hold `{key}:`, a list of entries each with a class_name")
    return entries


def load_class(name: str, folder: Path, where: str) -> type:
    """A class named as verl names them (``package.module.Class``: imported, or the file ``package/module.py``
    beside the config or in the working directory: run as a file of its own, or, inside a package (an
    ``__init__.py`` beside it, as in a verl checkout), imported as the package's module from that folder so its
    relative imports work) or as ``path/to/file.py:Class`` (beside the config first)."""
    if ":" in name:
        file, _, cls = name.rpartition(":")
        path = folder / file if (folder / file).is_file() else Path(file)
        return load_from_file(f"{path}:{cls}", "verl", "class", where)
    module, _, cls = name.rpartition(".")
    if not module:
        raise ValueError(f"{where}: class_name {name!r} must be 'package.module.Class' or 'file.py:Class'")
    for base in (folder, Path.cwd()):
        path = base / (module.replace(".", "/") + ".py")
        if path.is_file() and not (path.parent / "__init__.py").is_file():
            return load_from_file(f"{path}:{cls}", "verl", "class", where)
        if path.is_file() and str(base) not in sys.path:  # a package's module (verl's own, from a checkout):
            sys.path.append(str(base))  # imported as one, so its relative imports resolve
            break
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"{where}: cannot load class_name {name!r}: {type(e).__name__}: {e}") from None


class ToolSchema:
    """A JSON tool schema read like verl's pydantic one: ``schema.function.name``, ``schema.model_dump()``."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)
        for key, value in self._data.items():
            setattr(self, key, ToolSchema(value) if isinstance(value, Mapping) else value)

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return dict(self._data)


def _schema(data: Mapping[str, Any]) -> Any:
    try:
        from verl.tools.schemas import OpenAIFunctionToolSchema
    except ImportError:
        return ToolSchema(data)
    return OpenAIFunctionToolSchema.model_validate(dict(data))


async def _result(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _text(response: Any) -> str | None:
    """The text of a tool response: a str, ``{"text": ...}`` or an object with a str ``.text``; else None."""
    if isinstance(response, str):
        return response
    if isinstance(response, Mapping) and "text" in response:
        return str(response["text"])
    text = getattr(response, "text", None)
    return text if isinstance(text, str) else None


def execute_result(value: Any, owner: str) -> tuple[str, float]:
    """(text, reward) of what `owner`'s ``execute`` returned: verl's ``(response, reward, metrics)``, or a response
    alone (a plain str is one whole response, never a sequence to unpack) with reward 0. Raises `TypeError`
    naming `owner` for any other shape (the tool set counts it as a tool error)."""
    response, reward = (value[0], value[1] if len(value) > 1 else 0.0) if isinstance(value, tuple) and value \
        else (value, 0.0)
    text = _text(response)
    if text is None:
        raise TypeError(f"{owner}.execute returned {value!r:.80}: expected verl's (response, reward, metrics), or "
                        f"a response alone; a response is a str, {{'text': ...}} or an object with .text")
    try:
        return text, float(reward or 0.0)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}.execute returned the reward {reward!r:.40}: expected a number") from None


class VerlTool(Tool):
    """One verl `BaseTool` instance behind hybridflow's `Tool` protocol (see the module docstring)."""

    def __init__(self, tool: Any, schema: Mapping[str, Any]) -> None:
        function = schema.get("function") or {}
        self.verl_tool = tool
        self.name = getattr(tool, "name", None) or function.get("name", "")
        self.description = function.get("description", "")
        self.parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
        annotation = inspect.signature(tool.execute).parameters.get("parameters")
        self.json_arguments = annotation is not None and annotation.annotation in (str, "str")

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        kwargs = context.kwargs
        if "verl_instance" not in context.state:
            created = await _result(self.verl_tool.create(None, **(kwargs.get("create_kwargs") or {})))
            context.state["verl_instance"] = created[0] if isinstance(created, tuple) else created
        parameters = json.dumps(arguments) if self.json_arguments else arguments
        returned = await _result(self.verl_tool.execute(context.state["verl_instance"], parameters,
                                                         **(kwargs.get("execute_kwargs") or {})))
        text, reward = execute_result(returned, type(self.verl_tool).__name__)
        return ToolResult(text, reward=reward)

    async def finish(self, context: ToolContext) -> float:
        """verl's end of a trajectory: ``calc_reward`` (returned) then ``release``, for an instance it made."""
        instance = context.state.pop("verl_instance", None)
        if instance is None:
            return 0.0
        try:
            reward = await _result(self.verl_tool.calc_reward(instance, **(context.kwargs.get("calc_reward_kwargs")
                                                                            or {})))
        finally:
            await _result(self.verl_tool.release(instance, **(context.kwargs.get("release_kwargs") or {})))
        return float(reward or 0.0)


def load_tool_config(path: str, where: str) -> list[VerlTool]:
    """The tools of a verl tool config YAML (see the module docstring)."""
    tools = []
    for i, entry in enumerate(read_config(path, "tools", where)):
        at = f"{where} ({path}, tools[{i}])"
        kind = (entry.get("config") or {}).get("type", "native")
        if kind != "native":
            raise ValueError(f"{at}: config.type={kind!r}; only verl's native tools load here (MCP servers do not)")
        cls = load_class(entry["class_name"], Path(path).parent, at)
        if not callable(getattr(cls, "execute", None)):
            raise TypeError(f"{at}: {entry['class_name']} has no execute(instance_id, parameters) method; a verl "
                            f"BaseTool subclass was expected")
        schema = entry.get("tool_schema")
        function = schema.get("function") if isinstance(schema, Mapping) else None
        if not isinstance(schema, Mapping) or not isinstance(function, Mapping) or not function.get("name"):
            raise ValueError(f"{at}: {entry['class_name']} has no tool_schema with a function name (got "
                             f"{schema!r:.80}); verl's tool config gives every tool its OpenAI function schema: "
                             f"tool_schema: {{type: function, function: {{name, description, parameters}}}}")
        tool = cls(config=dict(entry.get("config") or {}), tool_schema=_schema(schema))
        tools.append(VerlTool(tool, schema))
    return tools
