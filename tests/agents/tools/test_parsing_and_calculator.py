"""The tool-call parser and the calculator on well-formed and hostile inputs: nothing raises, nothing
hangs, and every malformed call gets a message that tells the model what to write."""

from __future__ import annotations

import time

import pytest

from hybridflow.agents.tools.calculator import evaluate, format_number
from hybridflow.agents.tools.parsing import FORMAT, check_arguments, parse_tool_calls

SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"},
                                           "mode": {"type": "string", "enum": ["exact", "float"]}},
          "required": ["expression"], "additionalProperties": False}


def test_well_formed_calls_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            ' and <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": "lookup", "parameters": {"q": "x"}}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+3"}, None), ("python", {"code": "print(1)"}, None),
        ("lookup", {"q": "x"}, None)]
    assert parse_tool_calls("no calls here </tool_call> at all") == []


@pytest.mark.parametrize("body,why", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "a JSON list instead of an object"),
    ('{"arguments": {}}', 'no string "name"'),
    ('{"name": 7}', 'no string "name"'),
    ('{"name": "calculator", "arguments": [1]}', '"arguments" is a list'),
    ('{"name": "calculator", "arguments": "not an object"}', '"arguments" is a string that is not a JSON object'),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),  # recursion bomb
    ('{"name": "x", "arguments": {"a": ' + "9" * 100_000 + "}}", "not valid JSON"),  # int too long to parse
])
def test_malformed_calls_become_error_messages(body, why):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.name is None and why in call.error and FORMAT in call.error


def test_unclosed_and_huge_inputs_are_linear_and_safe():
    (call,) = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {}}')
    assert "never closed" in call.error
    hostile = "<tool_call>" * 50_000 + "x" * 1_000_000
    start = time.perf_counter()
    calls = parse_tool_calls(hostile)
    assert len(calls) == 1 and "never closed" in calls[0].error
    many = "<tool_call>{}</tool_call>" * 20_000
    assert len(parse_tool_calls(many)) == 20_000
    assert time.perf_counter() - start < 5.0


def test_arguments_are_checked_against_the_schema():
    assert check_arguments({"expression": "1"}, SCHEMA) is None
    assert "missing required argument(s) ['expression']" in check_arguments({}, SCHEMA)
    assert "unknown argument 'x'" in check_arguments({"expression": "1", "x": 1}, SCHEMA)
    assert "must be of type string, got int" in check_arguments({"expression": 1}, SCHEMA)
    assert "must be of type integer, got bool" in check_arguments({"expression": "1", "digits": True}, SCHEMA)
    assert "must be one of ['exact', 'float']" in check_arguments({"expression": "1", "mode": "x"}, SCHEMA)


@pytest.mark.parametrize("expression,value", [("2 + 3 * 4", "14"), ("(3 + 4) * 12 / 7", "12"), ("7 / 2", "3.5"),
                                              ("2 ** 10", "1024"), ("sqrt(16) + abs(-2)", "6"),
                                              ("1,234 * 2", "2468"), ("$15 - 4", "11"), ("-(5 // 2)", "-2"),
                                              ("round(pi, 3)", "3.142"), ("10 % 4", "2")])
def test_calculator_arithmetic(expression, value):
    assert format_number(evaluate(expression)) == value
    assert evaluate("-" * 499 + "1") == -1 and evaluate("(" * 200 + "1" + ")" * 200) == 1  # deep but bounded


@pytest.mark.parametrize("expression,why", [
    ("9 ** 9 ** 9", "too large"), ("10 ** 5000", "too large"), ("1 / 0", "division by zero"),
    ("__import__('os').system('ls')", "unsupported syntax"), ("().__class__", "unsupported syntax"),
    ("open('/etc/passwd')", "unsupported syntax"), ("x = 1", "cannot parse"), ("2 ^ 3", r"write \*\*"),
    ("(" * 400 + "1" + ")" * 400, "longer than 500"),
    ("'a' * 3", "not a number"), ("1e308 * 10", "too large"), ("", "empty"), ("sqrt(-1)", "math domain"),
    ("(-8) ** 0.5", "not a number"),
])
def test_calculator_refuses_hostile_and_bad_expressions(expression, why):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=why):
        evaluate(expression)
    assert time.perf_counter() - start < 1.0
