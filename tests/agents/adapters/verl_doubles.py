"""Doubles of verl's agent classes, written here from verl's public signatures (`BaseTool`: `__init__(config,
tool_schema)`, async `create`, `execute`, `calc_reward`, `release`; `BaseInteraction`: `__init__(config)`, async
`start_interaction`, `generate_response`, `calculate_score`, `finalize_interaction`), and the config YAMLs verl
reads them from. Every call is appended to the file named by the environment variable VERL_CALLS, so tests
see the order across processes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

TOOLS_MODULE = '''
import json, os
from uuid import uuid4


def log(*event):
    if os.environ.get("VERL_CALLS"):
        with open(os.environ["VERL_CALLS"], "a") as f:
            f.write(json.dumps(event) + "\\n")


class MultiplyTool:
    """Shaped like a verl BaseTool subclass: the schema comes in, instances are keyed by id."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
        self._instances = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"ground_truth": ground_truth, "last": None}
        log("create", instance_id, ground_truth)
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        factors = [int(x) for x in str(parameters["expression"]).split("*")]
        product = 1
        for f in factors:
            product *= f
        self._instances[instance_id]["last"] = str(product)
        log("execute", instance_id, parameters, kwargs)
        return {"text": f"{product}"}, self.config.get("step_reward", 0.0), {}

    async def calc_reward(self, instance_id, **kwargs):
        state = self._instances[instance_id]
        log("calc_reward", instance_id)
        return 1.0 if state["last"] == state["ground_truth"] else 0.0

    async def release(self, instance_id, **kwargs):
        log("release", instance_id)
        del self._instances[instance_id]


class JsonStringTool(MultiplyTool):
    """An older verl tool: `execute(..., parameters: str)` parses the JSON itself."""

    async def execute(self, instance_id, parameters: str, **kwargs):
        return await super().execute(instance_id, json.loads(parameters), **kwargs)


class StringTool(MultiplyTool):
    """Returns its response alone, a plain string (not verl's tuple)."""

    async def execute(self, instance_id, parameters, **kwargs):
        return (await super().execute(instance_id, parameters, **kwargs))[0]["text"]


class NumberTool(MultiplyTool):
    """Returns neither verl's tuple nor a response."""

    async def execute(self, instance_id, parameters, **kwargs):
        return 42


class SilentInteraction:
    """Goes on (should_terminate=False) with the response None."""

    def __init__(self, config):
        self.config = config

    async def start_interaction(self, instance_id=None, **kwargs):
        return "one"

    async def generate_response(self, instance_id, messages, **kwargs):
        return False, None, 0.0, {}


class EchoInteraction:
    """Shaped like a verl BaseInteraction subclass (verl's gsm8k interaction's flow)."""

    def __init__(self, config):
        self.config = config
        self.name = config.get("name", "interaction_agent")
        self._instances = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"ground_truth": ground_truth, "turns": 0}
        log("start", instance_id, ground_truth, sorted(kwargs))
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self._instances[instance_id]
        state["turns"] += 1
        last = messages[-1]["content"]
        log("respond", instance_id, [m["role"] for m in messages], last)
        if state["ground_truth"] in last:
            return True, "Correct.", 1.0, {}
        return False, self.config.get("retry", "Try again."), 0.0, {}

    async def calculate_score(self, instance_id, **kwargs):
        return 0.0

    async def finalize_interaction(self, instance_id, **kwargs):
        log("finalize", instance_id, self._instances.pop(instance_id)["turns"])
'''

SCHEMA = {"type": "function", "function": {"name": "calculator", "description": "Multiply integers.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string", "description": "like 6*7"}},
                                               "required": ["expression"]}}}


def write_verl_files(folder: Path, tool_class: str = "verl_like.MultiplyTool", schema: dict | None = SCHEMA
                     ) -> dict[str, Path]:
    """`verl_like.py` (the classes), `tool_config.yaml` and `interaction_config.yaml` in verl's shapes (`schema`
    None: the tool entry has no tool_schema)."""
    (folder / "verl_like.py").write_text(textwrap.dedent(TOOLS_MODULE))
    tools = folder / "tool_config.yaml"
    entry = {"class_name": tool_class, "config": {"type": "native", "step_reward": 0.25}}
    tools.write_text(json.dumps({"tools": [entry if schema is None else {**entry, "tool_schema": schema}]}))
    interactions = folder / "interaction_config.yaml"
    interactions.write_text(json.dumps({"interaction": [{"name": "echo", "class_name": "verl_like.EchoInteraction",
                                                         "config": {"retry": "Not yet."}}]}))
    return {"module": folder / "verl_like.py", "tools": tools, "interactions": interactions}


def read_calls(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def verl_row(i: int, answer: str) -> dict:
    """A verl multi-turn row: tools_kwargs and interaction_kwargs in extra_info."""
    return {"prompt": [{"role": "user", "content": f"What is {i} times 7?"}], "data_source": "toy",
            "reward_model": {"ground_truth": answer},
            "extra_info": {"index": i, "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": answer}}},
                           "interaction_kwargs": {"name": "echo", "query": f"What is {i} times 7?",
                                                  "ground_truth": answer}}}
