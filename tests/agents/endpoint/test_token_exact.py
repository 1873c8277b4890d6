"""The token-exact check on the Qwen2.5, Qwen3, Llama 3 and SmolLM2 chat formats: a conversation served by the
endpoint (a scripted model writing each format's canonical answers) is stitched into exactly the ids the
template gives its final conversation, in one segment; a model turn the template renders differently is
counted at the first differing token; a template that re-renders history starts a new segment."""

from __future__ import annotations

import asyncio

import pytest

from chat_formats import chat_tokenizer
from endpoint_helpers import ScriptedDriver, client, serving
from hybridflow.agents.endpoint.token_check import first_mismatch
from hybridflow.agents.tools.toolset import ToolSet
from hybridflow.engine.rollout import SamplingParams

TOOLS = ToolSet(["calculator"]).schemas()
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
QUESTION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 6 * 7?"}]
# per family: the model's answers, in the family's own format, and whether they call the tool
SCRIPTS = {
    "qwen2.5": ([CALL, "The answer is 42."], True),
    "qwen3": (["<think>\nI should compute it.\n</think>\n\n" + CALL, "<think>\n6*7 is 42.\n</think>\n\nIt is 42."],
              True),
    "llama3": (["It is 42.", "Yes, 42."], False),
    "smollm2": (["It is 42.", "Yes, 42."], False),
}


def converse(family: str, answers: list[str], tools: bool, follow_up: str = "Are you sure?"):
    """Two requests as an agent sends them: the question, then the answer and a tool result (or a user
    message). Returns the tokenizer, the endpoint's trajectory, the final conversation and the driver."""
    tokenizer = chat_tokenizer(family)
    driver = ScriptedDriver(tokenizer, answers, tokenizer.eos_token_id)
    params = SamplingParams(temperature=1.0, max_tokens=64)

    async def main():
        async with serving(tokenizer, driver, params, budget=400, max_prompt_length=600) as (endpoint, port):
            lane = endpoint.open("t")
            api = client(port, "t")
            extra = {"tools": TOOLS} if tools else {}
            first = await api.chat.completions.create(model="policy", messages=QUESTION, **extra)
            message = first.choices[0].message
            reply = ({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"} if tools
                     else {"role": "user", "content": follow_up})
            conversation = [*QUESTION, message.model_dump(exclude_none=True), reply]
            second = await api.chat.completions.create(model="policy", messages=conversation, **extra)
            final = [*conversation, second.choices[0].message.model_dump(exclude_none=True)]
            lane.end(driver.release)  # the runner returns
            return lane.finish(endpoint.renderers), final

    trajectory, final = asyncio.run(main())
    return tokenizer, trajectory, final, driver


def rendered_ids(tokenizer, final, tools: bool) -> list[int]:
    """The template's ids of the final conversation, up to the end of the last model turn."""
    text = tokenizer.apply_chat_template(normalized(final), tokenize=False, **({"tools": TOOLS} if tools else {}))
    end = text.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)
    return tokenizer(text[:end], add_special_tokens=False)["input_ids"]


def normalized(messages):
    import json

    out = []
    for m in messages:
        m = dict(m)
        m["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                                 "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("family", sorted(SCRIPTS))
def test_stitched_ids_are_the_templates_ids_of_the_final_conversation(family):
    answers, tools = SCRIPTS[family]
    tokenizer, trajectory, final, driver = converse(family, answers, tools)
    assert trajectory.token_mismatch == 0 and trajectory.segments == 1 and trajectory.turns == 2
    assert [call[0] for call in driver.calls] == ["start", "extend"]  # the second request continued the first
    assert trajectory.prompt_ids + trajectory.token_ids == rendered_ids(tokenizer, final, tools)
    assert trajectory.prompt_ids + trajectory.token_ids == driver.sequences[0]  # what the "engine" held
    if tools:
        assert final[2]["tool_calls"][0]["function"]["arguments"] == '{"expression": "6*7"}'


def test_a_model_turn_the_template_renders_otherwise_is_counted_where_it_differs():
    compact = '<tool_call>{"name":"calculator","arguments":{"expression":"6*7"}}</tool_call>'
    tokenizer, trajectory, final, _ = converse("qwen2.5", [compact, "The answer is 42."], tools=True)
    assert trajectory.segments == 1 and trajectory.token_mismatch == 1  # continued (same message), not exact
    text = tokenizer.apply_chat_template(normalized(final), tokenize=False, tools=TOOLS)
    position = first_mismatch(tokenizer, trajectory.prompt_ids, trajectory.token_ids, trajectory.response_mask,
                              text, "\n")
    tool_call_token = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert position == len(trajectory.prompt_ids) + trajectory.token_ids.index(tool_call_token) + 1  # after it: \n


def test_qwen3_dropping_earlier_reasoning_starts_a_new_segment_that_is_exact():
    answers = ["<think>\nEasy.\n</think>\n\nIt is 42.", "<think>\nStill 42.\n</think>\n\nYes."]
    tokenizer, trajectory, final, driver = converse("qwen3", answers, tools=False)
    assert [call[0] for call in driver.calls] == ["start", "start"] and driver.released == {0, 1}
    assert trajectory.segments == 2 and trajectory.turns == 1 and trajectory.token_mismatch == 0
    assert trajectory.prompt_ids + trajectory.token_ids == rendered_ids(tokenizer, final, tools=False)
    prompt = tokenizer.decode(trajectory.prompt_ids)
    assert "Easy." not in prompt and "<|im_start|>assistant\nIt is 42.<|im_end|>" in prompt
