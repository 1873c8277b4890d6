"""The built-in `calculator` tool: arithmetic evaluated from the expression's syntax tree (never `eval`),
bounded so that no input can hang or exhaust memory: at most 500 characters, numbers up to 10**1000,
powers whose result would pass that refused before they are computed."""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from hybridflow.agents.tools.tool import Tool, ToolContext, ToolResult

MAX_LENGTH, MAX_MAGNITUDE = 500, 10**1000
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor,
                                             "ceil": math.ceil, "log": math.log, "exp": math.exp, "min": min,
                                             "max": max}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _bounded(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("the result is too large")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if base not in (0, 1, -1) and abs(exponent) * math.log10(max(abs(base), 1e-300)) > 1000:
        raise ValueError("the result is too large")
    return base ** exponent


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return _bounded(node.value)
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
            and not node.keywords:
        return _bounded(_FUNCTIONS[node.func.id](*[_evaluate(a) for a in node.args]))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("^ is not a power here; write ** (2 ** 3 = 8)")
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring); ValueError says what is wrong."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("the expression is empty")
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(_THOUSANDS.sub("", expression.strip().replace("$", "")), mode="eval")
        return _evaluate(tree)
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"cannot parse the expression ({type(e).__name__})") from None
    except (ZeroDivisionError, OverflowError, TypeError, ValueError) as e:
        raise ValueError(str(e) or type(e).__name__) from None


def format_number(value: int | float) -> str:
    """Integers as they are; floats with 12 significant digits (integral ones without a fraction)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class Calculator(Tool):
    name = "calculator"
    description = ("Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, and sqrt, abs, "
                   "round, floor, ceil, log, exp, min, max, pi, e.")
    parameters = {"type": "object", "properties": {"expression": {
        "type": "string", "description": "the expression, e.g. (3 + 4) * 12 / 7"}}, "required": ["expression"]}

    def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        try:
            return ToolResult(format_number(evaluate(arguments["expression"])))
        except ValueError as e:
            return ToolResult(f"Error: {e}", error=True)
