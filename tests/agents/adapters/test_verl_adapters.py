"""verl's tools and interactions load unchanged (issue 36, item 9): a verl tool config YAML with a
`BaseTool`-shaped class, and a `BaseInteraction`-shaped class or verl's interaction config YAML, called with
their own method names through hybridflow's tool and environment protocols; tool arguments are converted to
their declared types as verl's tools convert them. The classes are doubles written from verl's public
signatures (`verl_doubles`)."""

from __future__ import annotations

import asyncio

import pytest
from verl_doubles import SCHEMA, read_calls, verl_row, write_verl_files

from hybridflow.agents.loop.environment import environment_kwargs, load_environment
from hybridflow.agents.tools.parsing import ToolCall, coerce_arguments
from hybridflow.agents.tools.tool import Scratch
from hybridflow.agents.tools.toolset import ToolSet


@pytest.fixture
def verl_files(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.chdir(tmp_path / "..")  # class_name resolves beside the YAML, not from the working directory
    return write_verl_files(tmp_path)


def test_a_verl_tool_config_yaml_runs_create_execute_calc_reward_release(verl_files, tmp_path):
    tools = ToolSet([str(verl_files["tools"])])
    assert tools.schemas() == [SCHEMA]
    row = {k: v for k, v in verl_row(6, "42").items() if k in ("extra_info",)}
    contexts = tools.contexts(row, Scratch())

    async def trajectory():
        first = await tools.run(ToolCall("calculator", {"expression": "6*7"}), contexts["calculator"], 5.0)
        second = await tools.run(ToolCall("calculator", {"expression": 12}), contexts["calculator"], 5.0)  # coerced
        return first, second, await tools.finish(contexts, 5.0)

    first, second, final = asyncio.run(trajectory())
    assert (first.text, first.reward, first.error) == ("42", 0.25, False) and second.text == "12"
    assert final == 0.0  # the last result (12) is not the ground truth
    calls = read_calls(tmp_path / "calls.jsonl")
    assert [c[0] for c in calls] == ["create", "execute", "execute", "calc_reward", "release"]
    assert calls[0][2] == "42" and len({c[1] for c in calls}) == 1  # one instance for the trajectory
    assert calls[2][2] == {"expression": "12"}
    assert asyncio.run(tools.finish(contexts, 5.0)) == 0.0  # released: nothing left to finish


def test_an_older_verl_tool_gets_its_arguments_as_a_json_string(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CALLS", str(tmp_path / "calls.jsonl"))
    files = write_verl_files(tmp_path, tool_class="verl_like.JsonStringTool")
    tools = ToolSet([str(files["tools"])])
    contexts = tools.contexts({"extra_info": {}}, Scratch())
    result = asyncio.run(tools.run(ToolCall("calculator", {"expression": "3*5"}), contexts["calculator"], 5.0))
    assert result.text == "15" and not result.error


@pytest.mark.parametrize("tool_class,text,error", [
    ("StringTool", "15", False),  # a plain string is the whole response, not unpacked character by character
    ("NumberTool", "Error: calculator failed: TypeError: NumberTool.execute returned 42: expected verl's (response, "
                   "reward, metrics), or a response alone", True)])
def test_a_verl_tool_returning_a_response_alone_or_another_shape(tmp_path, monkeypatch, tool_class, text, error):
    monkeypatch.setenv("VERL_CALLS", str(tmp_path / "calls.jsonl"))
    tools = ToolSet([str(write_verl_files(tmp_path, tool_class=f"verl_like.{tool_class}")["tools"])])
    contexts = tools.contexts({"extra_info": {}}, Scratch())
    result = asyncio.run(tools.run(ToolCall("calculator", {"expression": "3*5"}), contexts["calculator"], 5.0))
    assert result.text.startswith(text) and (result.reward, result.error) == (0.0, error)


def test_a_verl_tool_entry_without_its_schema_is_refused_naming_the_entry(tmp_path):
    files = write_verl_files(tmp_path, schema=None)
    with pytest.raises(ValueError) as e:
        ToolSet([str(files["tools"])])
    assert f"({files['tools']}, tools[0]): verl_like.MultiplyTool has no tool_schema with a function name" \
           in str(e.value)


def test_an_interaction_answering_none_is_an_environment_error_naming_the_class(verl_files):
    env_class = load_environment(f"{verl_files['module']}:SilentInteraction")
    env = env_class(verl_row(1, "7"), **environment_kwargs(env_class, {}, verl_row(1, "7")))
    with pytest.raises(TypeError, match=r"SilentInteraction.generate_response returned the response None with "
                                        r"should_terminate=False: the next user message must be a str"):
        asyncio.run(env.step("It is 7.", 0))


def test_a_verl_tool_named_as_a_class_is_refused_with_the_yaml_to_write(verl_files):
    with pytest.raises(TypeError, match=r"is a verl BaseTool: list it in a verl tool config YAML"):
        ToolSet([f"{verl_files['module']}:MultiplyTool"])


def test_tool_arguments_are_converted_to_their_declared_types():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                               "flag": {"type": "boolean"}, "s": {"type": "string"},
                                               "either": {"type": ["integer", "string"]}}}
    assert coerce_arguments({"n": "3", "x": "2.5", "flag": "True", "s": 7, "either": "4", "other": "1"}, schema) == \
        {"n": 3, "x": 2.5, "flag": True, "s": "7", "either": 4, "other": "1"}
    assert coerce_arguments({"n": "3.5", "x": "two", "flag": "yes"}, schema) == {"n": "3.5", "x": "two", "flag": "yes"}


@pytest.mark.parametrize("spec", ["interactions", "class"])
def test_a_verl_interaction_drives_an_episode(verl_files, tmp_path, spec):
    env_class = load_environment(str(verl_files["interactions"]) if spec == "interactions"
                                 else f"{verl_files['module']}:EchoInteraction")
    row = {"raw_prompt": [{"role": "user", "content": "What is 6 times 7?"}], **verl_row(6, "42")}
    env = env_class(row, **environment_kwargs(env_class, {}, row))

    async def episode():
        steps = [await env.step("It is 40.", 0), await env.step("It is 42.", 1)]
        await env.close()
        return steps

    wrong, right = asyncio.run(episode())
    retry = "Not yet." if spec == "interactions" else "Try again."  # the YAML's config reaches the class
    assert (wrong.message, wrong.reward, wrong.done) == (retry, 0.0, False)
    assert (right.message, right.reward, right.done) == (None, 1.0, True)
    calls = read_calls(tmp_path / "calls.jsonl")
    assert [c[0] for c in calls] == ["start", "respond", "respond", "finalize"]
    assert calls[0][2] == "42" and calls[0][3] == ["name", "query"]  # interaction_kwargs, ground_truth by name
    assert calls[2][2] == ["user", "assistant", "user", "assistant"] and calls[2][3] == "It is 42."
    assert calls[3][2] == 2


def test_an_interaction_config_refuses_a_row_naming_no_interaction(verl_files):
    env_class = load_environment(str(verl_files["interactions"]))
    row = verl_row(1, "7")
    row["extra_info"]["interaction_kwargs"]["name"] = "missing"
    with pytest.raises(KeyError, match=r"interaction_kwargs.name='missing' names none of the interactions \['echo'\]"):
        env_class(row, **environment_kwargs(env_class, {}, row))


def test_verl_tools_and_interaction_through_training(tool_calling_model, tmp_path, monkeypatch):
    """`hybridflow train` with verl's tool config and interaction config on verl's multi-turn rows: the model
    (trained to call `calculator`) calls the verl tool, whose step and final rewards reach the trajectory."""
    import json

    from hybridflow import cli

    calls_file = tmp_path / "calls.jsonl"
    monkeypatch.setenv("VERL_CALLS", str(calls_file))
    files = write_verl_files(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(verl_row(i, "42")) + "\n" for i in range(2)))
    out = tmp_path / "run"
    assert cli.main(["train", "--config", "recipes/grpo.yaml", f"model.path={tool_calling_model}",
                     f"data.train_files={data}", "data.train_batch_size=2", "data.max_prompt_length=128",
                     "data.max_response_length=200", "algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1",
                     "rollout.temperature=0", "actor.mini_batch_size=null", "trainer.total_steps=1",
                     "trainer.val_before_train=false", "reward.num_workers=0", "reward.function=environment",
                     f"agent.tools=[{files['tools']}]", f"agent.environment={files['interactions']}",
                     "agent.max_turns=2", f"trainer.output_dir={out}"]) == 0
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["agent/tool_calls/mean"] == 1 and metrics["agent/tool_errors"] == 0
    assert metrics["agent/env_errors"] == 0 and metrics["agent/turns/mean"] == 2
    assert metrics["agent/env_reward/mean"] == 1.25 and metrics["reward/mean"] == 1.25  # 0.25 per call + 1 at the end
    events = [c[0] for c in read_calls(calls_file)]
    assert sorted(events) == sorted(["create", "execute", "calc_reward", "release", "start", "respond",
                                     "finalize"] * 2)
