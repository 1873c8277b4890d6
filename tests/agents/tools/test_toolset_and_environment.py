"""Building tools and environments from the config: the forms an entry may take, and the errors that
name the entry and what would be valid; tool calls that fail answer the model instead of raising."""

from __future__ import annotations

import asyncio

import pytest

from hybridflow.agents.loop.environment import EnvStep, as_env_step, load_environment
from hybridflow.agents.tools.parsing import ToolCall
from hybridflow.agents.tools.tool import Scratch, ToolContext
from hybridflow.agents.tools.toolset import ToolSet

USER_TOOLS = """
    import sys, time
    from hybridflow.agents import Tool, ToolResult

    class Lookup(Tool):
        name = "lookup"
        description = "Look a word up."
        parameters = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}

        def __init__(self, prefix=">"):
            self.prefix = prefix

        def call(self, arguments, context):
            if arguments["word"] == "boom":
                raise RuntimeError("lookup exploded")
            if arguments["word"] == "slow":
                time.sleep(1.5)
            if arguments["word"] == "number":
                return 3
            if arguments["word"] == "wrapped number":
                return ToolResult(3)
            if arguments["word"] == "exit":
                sys.exit("bye")
            if arguments["word"] == "interrupt":
                raise KeyboardInterrupt
            return self.prefix + arguments["word"]

    NOT_A_TOOL = 1
"""


def run(tools: ToolSet, call: ToolCall, timeout_s: float = 2.0):
    context = ToolContext({}, {}, Scratch())
    return asyncio.run(tools.run(call, context, timeout_s))


def test_entries_of_every_form_and_their_schemas(env_file):
    path = env_file(USER_TOOLS)
    tools = ToolSet(["calculator", f"{path}:Lookup",
                     {"name": "py", "class": "python", "description": "Run code.", "kwargs": {"timeout_s": 3}}])
    assert list(tools.tools) == ["calculator", "lookup", "py"]
    assert tools.tools["py"].limits.timeout_s == 3
    schema = tools.schemas()[2]
    assert schema == {"type": "function", "function": {"name": "py", "description": "Run code.",
                                                       "parameters": tools.tools["py"].parameters}}
    assert run(tools, ToolCall("lookup", {"word": "cat"})).text == ">cat"
    assert run(tools, ToolCall("calculator", {"expression": "6*7"})).text == "42"


def test_failing_calls_answer_the_model(env_file):
    tools = ToolSet([f"{env_file(USER_TOOLS)}:Lookup"])
    for call, text in [(ToolCall(None, error="Error: malformed tool call (x)"), "Error: malformed tool call (x)"),
                       (ToolCall("search", {}), "Error: there is no tool 'search'; the tools are lookup"),
                       (ToolCall("lookup", {}),
                        "Error: lookup: missing required argument(s) ['word']; the tool takes ['word']"),
                       (ToolCall("lookup", {"word": "boom"}), "Error: lookup failed: RuntimeError: lookup exploded"),
                       (ToolCall("lookup", {"word": "slow"}),
                        "Error: lookup failed: TimeoutError: no answer within 0.5 s"),
                       (ToolCall("lookup", {"word": "number"}), "Error: lookup returned a int, not text"),
                       (ToolCall("lookup", {"word": "wrapped number"}),
                        "Error: lookup returned a ToolResult whose text is a int, not a str"),
                       (ToolCall("lookup", {"word": "exit"}), "Error: lookup failed: SystemExit: bye"),
                       (ToolCall("lookup", {"word": "interrupt"}), "Error: lookup failed: KeyboardInterrupt: ")]:
        result = run(tools, call, timeout_s=0.5)
        assert result.error and result.text == text



def test_a_call_naming_no_tool_is_answered_without_a_context(env_file):
    """The host process has a context per tool only: a call of another name is answered with the tool list; a
    call of a tool without its context is the caller's error."""
    tools = ToolSet([f"{env_file(USER_TOOLS)}:Lookup"])
    answer = asyncio.run(tools.run(ToolCall("search", {}), None, 2.0))
    assert answer.error and answer.text == "Error: there is no tool 'search'; the tools are lookup"
    with pytest.raises(ValueError, match="no ToolContext given for the call of tool 'lookup'"):
        asyncio.run(tools.run(ToolCall("lookup", {"word": "cat"}), None, 2.0))

def test_bad_entries_are_refused_with_their_index(env_file):
    path = env_file(USER_TOOLS)
    cases = [(["calculater"], r"agent.tools\[0\]: 'calculater' is neither a built-in tool \(calculator, python\)"),
             ([{"name": "calculator", "clas": "x"}], r"agent.tools\[0\] has unknown keys \['clas'\]; valid: name"),
             ([f"{path}:NOT_A_TOOL"], r"must be a class with a call\(arguments, context\) method"),
             ([f"{path}:Lookp"], r"has no class 'Lookp'; did you mean 'Lookup'\?"),
             ([{"class": f"{path}:Lookup", "kwargs": {"suffix": 1}}], r"cannot build .*unexpected keyword"),
             (["calculator", {"class": "python", "name": "calculator"}], r"agent.tools\[1\]: a second tool named"),
             ([{"class": "calculator", "parameters": {"type": "string"}}], r"must be a JSON schema of type 'object'"),
             ([3], r"agent.tools\[0\] must be a tool name")]
    for entries, message in cases:
        with pytest.raises((ValueError, TypeError, AttributeError), match=message):
            ToolSet(entries)


def test_environment_loading_and_steps(env_file):
    path = env_file("class Env:\n    def step(self, text, turn):\n        return None\n\nNOT_ENV = 1\n")
    assert load_environment(f"{path}:Env").__name__ == "Env"
    with pytest.raises(TypeError, match=r"must name a class with a step\(text, turn\) method"):
        load_environment(f"{path}:NOT_ENV")
    with pytest.raises(FileNotFoundError, match="agent.environment"):
        load_environment("missing.py:Env")
    assert as_env_step(None, "x") == EnvStep() and as_env_step("hi", "x") == EnvStep("hi")
    assert as_env_step(EnvStep("t", role="tool", reward=1), "x").reward == 1.0
    with pytest.raises(TypeError, match="my.py step\\(\\) returned a dict; return an EnvStep"):
        as_env_step({"message": "x"}, "my.py step()")
