"""Tool calls in a model turn, in the Hermes / Qwen format, and their arguments checked against a schema.

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

`parse_tool_calls(text)` returns one `ToolCall` per `<tool_call>` block, in order ([] when the turn
has none). A block that is not a JSON object with a string `name` and an object `arguments` (also
accepted: `arguments` as a JSON string holding an object, or `parameters` for `arguments`), or that
is never closed, gives a `ToolCall` with `error` set: the loop answers it with that message and runs
nothing. The scan is linear in the text and nothing here raises on any input. `coerce_arguments` converts
values to their declared types where nothing is lost, before `check_arguments` checks them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMAT = '<tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>'
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
               "array": (list,), "null": (type(None),)}


@dataclass
class ToolCall:
    """name and arguments of a well-formed call; `error` (and no name) for a malformed one."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _malformed(why: str) -> ToolCall:
    return ToolCall(None, error=f"Error: malformed tool call ({why}); write {FORMAT}")


def _parse_block(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as e:
        return _malformed(f"not valid JSON: {str(e)[:80]}")
    if not isinstance(call, dict):
        return _malformed(f"a JSON {type(call).__name__} instead of an object")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return _malformed('no string "name"')
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return _malformed('"arguments" is a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return _malformed(f'"arguments" is a {type(arguments).__name__}, not an object')
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of one model turn (see the module docstring)."""
    calls, position = [], 0
    while (start := text.find(OPEN, position)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            calls.append(_malformed(f"{OPEN} is never closed by {CLOSE}"))
            break
        calls.append(_parse_block(text[start + len(OPEN):end]))
        position = end + len(CLOSE)
    return calls


def _coerce(value: Any, kinds: list[str]) -> Any:
    """`value` as the first of the schema's `kinds` it converts to without loss (a numeric string to a
    number, ``"true"``/``"false"`` to a boolean, a number to a string); else `value` unchanged."""
    for kind in kinds:
        if isinstance(value, _JSON_TYPES.get(kind, ())) and not (isinstance(value, bool) and kind != "boolean"):
            return value
        if isinstance(value, str) and kind in ("integer", "number"):
            try:
                number = float(value.strip())
            except ValueError:
                continue
            if kind == "number":
                return int(number) if number.is_integer() and "." not in value else number
            if number.is_integer():
                return int(number)
        elif isinstance(value, str) and kind == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        elif kind == "string" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    return value


def coerce_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """The arguments with each top-level value converted to its declared type where that loses nothing
    (``"3"`` for an integer is 3), as verl's tools convert what the model wrote; the rest unchanged."""
    properties = schema.get("properties") or {}
    out = {}
    for key, value in arguments.items():
        kinds = (properties.get(key) or {}).get("type")
        out[key] = _coerce(value, [kinds] if isinstance(kinds, str) else list(kinds or []))
    return out


def check_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """None when `arguments` fit the JSON schema's top level (required keys present, no unknown key when
    additionalProperties is false, declared types and enums respected); else what is wrong."""
    properties = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}; the tool takes {sorted(properties)}"
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            if schema.get("additionalProperties") is False:
                return f"unknown argument {key!r}; the tool takes {sorted(properties)}"
            continue
        kinds = spec.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, (object,)))
        if allowed and (not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed):
            return f"argument {key!r} must be of type {'/'.join(kinds)}, got {type(value).__name__}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return None
