"""The OpenAI-compatible endpoint on a tiny engine, driven by the real `openai` client: chat with n > 1 and
log-probs stitched into one token sequence, tool calls in OpenAI's form, stop strings, raw completions,
the concurrency cap, and OpenAI-style errors for what the engine cannot serve."""

from __future__ import annotations

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

from endpoint_helpers import ScriptedDriver, client, engine_driver, launch_as_on_a_gpu, serving
from hybridflow.agents.tools.toolset import ToolSet
from hybridflow.engine.rollout import RolloutEngine, SamplingParams

TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'  # the model's


@pytest.fixture(scope="module")
def tiny(tiny_qwen2):
    return AutoTokenizer.from_pretrained(tiny_qwen2), RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=16,
                                                                                    max_model_len=320)


def test_chat_with_n_and_logprobs_is_stitched_into_the_sampled_ids(tiny):
    tokenizer, engine = tiny
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=0)

    async def main():
        async with serving(tokenizer, engine_driver(engine, params), params, budget=80) as (endpoint, port):
            lane = endpoint.open("k1")
            api = client(port, "k1")
            question = [{"role": "user", "content": "What is 2 + 2?"}]
            first = await api.chat.completions.create(model="policy", messages=question, n=2, logprobs=True)
            assert len(first.choices) == 2
            assert first.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in first.choices)
            picked = first.choices[1]
            follow = [*question, picked.message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
            second = await api.chat.completions.create(model="policy", messages=follow, max_tokens=5, logprobs=True)
            return endpoint, lane, first, picked, second

    endpoint, lane, first, picked, second = asyncio.run(main())
    trajectory = lane.finish(endpoint.renderers)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                           add_generation_prompt=True)
    assert trajectory.prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert first.usage.prompt_tokens == len(trajectory.prompt_ids)
    sampled = picked.model_extra["token_ids"]
    answer = second.choices[0].model_extra["token_ids"]
    assert 1 <= len(answer) <= 5 and trajectory.segments == 1 and trajectory.turns == 2
    assert trajectory.token_ids[:len(sampled)] == sampled and trajectory.token_ids[-len(answer):] == answer
    appended = trajectory.token_ids[len(sampled):-len(answer)]
    assert trajectory.response_mask == [1] * len(sampled) + [0] * len(appended) + [1] * len(answer)
    returned = [t.logprob for t in picked.logprobs.content] + [t.logprob for t in second.choices[0].logprobs.content]
    model_logprobs = [lp for lp, m in zip(trajectory.logprobs, trajectory.response_mask) if m]
    assert model_logprobs == pytest.approx(returned) and all(lp < 0 for lp in returned)
    assert picked.message.content == tokenizer.decode(sampled, skip_special_tokens=True)
    assert trajectory.token_mismatch == 0 and trajectory.kv_reused_tokens > len(trajectory.prompt_ids)
    assert second.usage.prompt_tokens == len(trajectory.prompt_ids) + len(sampled) + len(appended)


def test_tool_calls_come_back_in_openai_form_and_stop_strings_cut_the_turn(tool_calling_model):
    tokenizer = AutoTokenizer.from_pretrained(tool_calling_model)
    engine = RolloutEngine.from_pretrained(tool_calling_model, max_num_seqs=4, max_model_len=320)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    tools = ToolSet(["calculator"]).schemas()
    question = [{"role": "user", "content": "What is 6 * 7?"}]

    async def main():
        async with serving(tokenizer, engine_driver(engine, params), params, budget=200) as (endpoint, port):
            calls, cut = endpoint.open("calls"), endpoint.open("cut")
            reply = await client(port, "calls").chat.completions.create(model="policy", messages=question,
                                                                         tools=tools)
            message = reply.choices[0].message
            follow = [*question, message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}]
            again = await client(port, "calls").chat.completions.create(model="policy", messages=follow, tools=tools)
            plain = await client(port, "cut").chat.completions.create(model="policy", messages=question, tools=tools,
                                                                       tool_choice="none", stop=["calculator"])
            return endpoint, calls, cut, reply, again, plain

    endpoint, calls, cut, reply, again, plain = asyncio.run(main())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert call.function.arguments == '{"expression": "6*7"}' and call.id.startswith("call_")
    assert again.choices[0].message.tool_calls  # the tool result was appended to the held sequence
    trajectory = calls.finish(endpoint.renderers)
    assert trajectory.segments == 1 and trajectory.turns == 2
    # this template renders an assistant message's content only, never its tool calls: the final conversation
    # is not what the model saw, and the check says where (the first sampled token)
    assert trajectory.token_mismatch == 1
    text = plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "stop" and TOOL_CALL.startswith(text) and text.endswith('"name": "')
    kept = plain.choices[0].model_extra["token_ids"]
    assert tokenizer.decode(kept).startswith(text + "calculator")  # ids up to the token completing the stop
    assert cut.finish(endpoint.renderers).token_ids == kept


def test_raw_completions_continue_on_text_and_ids(tiny):
    tokenizer, engine = tiny
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1)

    async def main():
        async with serving(tokenizer, engine_driver(engine, params), params) as (endpoint, port):
            lane = endpoint.open("c")
            api = client(port, "c")
            first = await api.completions.create(model="policy", prompt="Once upon a time", logprobs=1)
            grown = "Once upon a time" + first.choices[0].text + " then"
            second = await api.completions.create(model="policy", prompt=grown, max_tokens=3)
            return endpoint, lane, first, second

    endpoint, lane, first, second = asyncio.run(main())
    trajectory = lane.finish(endpoint.renderers)
    assert len(first.choices[0].logprobs.token_logprobs) == len(first.choices[0].model_extra["token_ids"])
    if first.choices[0].finish_reason == "length":  # not ended on a stop token: the text view is exact
        assert trajectory.segments == 1 and trajectory.turns == 2
        assert tokenizer.decode(trajectory.prompt_ids + trajectory.token_ids) == (
            "Once upon a time" + first.choices[0].text + " then" + second.choices[0].text)
    else:
        assert trajectory.segments == 2


def test_the_concurrency_cap_and_openai_style_errors(tiny):
    tokenizer, engine = tiny
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=2)
    question = [{"role": "user", "content": "Hi"}]

    async def main():
        async with serving(tokenizer, engine_driver(engine, params), params, budget=8, max_concurrent=2) as (
                endpoint, port):
            keys = [f"lane{i}" for i in range(6)]
            for key in keys:
                endpoint.open(key)
            replies = await asyncio.gather(*(client(port, k).chat.completions.create(model="policy", messages=question)
                                             for k in keys))
            errors = {}
            api = client(port, "lane0")
            bad = {"model": dict(model="gpt-4o"), "temperature": dict(temperature=0.5), "stream": dict(stream=True),
                   "top_logprobs": dict(logprobs=True, top_logprobs=3), "tool_choice": dict(tool_choice="required"),
                   "seed": dict(seed=3), "messages": dict(messages=[{"role": "robot", "content": "x"}])}
            for name, change in bad.items():
                try:
                    await api.chat.completions.create(**{"model": "policy", "messages": question, **change})
                except openai.APIStatusError as e:
                    errors[name] = (e.status_code, e.body)
            for name, call in {"key": client(port, "lane0", api_key="wrong"), "lane": client(port, "nope")}.items():
                try:
                    await call.chat.completions.create(model="policy", messages=question)
                except openai.APIStatusError as e:
                    errors[name] = (e.status_code, e.body)
            long = [*question, replies[1].choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "a much longer message than the budget holds " * 3}]
            try:
                await client(port, "lane1").chat.completions.create(model="policy", messages=long)
            except openai.APIStatusError as e:
                errors["budget"] = (e.status_code, e.body)
            return endpoint, replies, errors

    endpoint, replies, errors = asyncio.run(main())
    assert all(r.choices[0].message.role == "assistant" for r in replies)
    assert endpoint.stats["peak_concurrent"] == 2  # six requests at once, two served at a time
    assert errors["model"][0] == 404 and errors["model"][1]["code"] == "model_not_found"
    assert errors["temperature"][0] == 400 and "rollout.temperature" in errors["temperature"][1]["message"]
    assert errors["temperature"][1]["param"] == "temperature"
    assert {errors[k][0] for k in ("stream", "top_logprobs", "tool_choice", "seed", "messages")} == {400}
    assert all(set(body) == {"message", "type", "param", "code"} for _, body in errors.values())
    assert errors["key"][0] == 401 and errors["key"][1]["code"] == "invalid_api_key"
    assert errors["lane"][0] == 404 and errors["lane"][1]["code"] == "trajectory_not_found"
    assert errors["budget"][0] == 400 and errors["budget"][1]["code"] == "context_length_exceeded"
    assert "maximum context length" in errors["budget"][1]["message"] and endpoint.lanes["lane1"].trajectory.cut_by_budget


def test_concurrent_conversations_with_the_engine_stepped_from_a_worker_thread(tiny, monkeypatch):
    """The driver's GPU path (a worker thread collects each step and launches the next) under the endpoint's
    traffic: eight two-turn conversations at once, one per KV slot, whose requests arrive, extend and shorten
    their sequences while steps run. Every trajectory is stitched from the sampled ids, two turns each."""
    tokenizer, engine = tiny
    launch_as_on_a_gpu(monkeypatch)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)

    async def converse(port: int, key: str) -> None:
        api = client(port, key)
        messages = [{"role": "user", "content": f"Count to {len(key)}."}]
        first = await api.chat.completions.create(model="policy", messages=messages, logprobs=True)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        await api.chat.completions.create(model="policy", messages=messages, max_tokens=4, logprobs=True)

    async def main():
        async with serving(tokenizer, engine_driver(engine, params), params, budget=60) as (endpoint, port):
            lanes = {f"lane{i}": endpoint.open(f"lane{i}") for i in range(8)}
            await asyncio.gather(*(converse(port, key) for key in lanes))
            return endpoint, lanes

    endpoint, lanes = asyncio.run(asyncio.wait_for(main(), timeout=120))
    trajectories = [lane.finish(endpoint.renderers) for lane in lanes.values()]
    assert all(t.dropped is None and t.turns == 2 and t.segments == 1 for t in trajectories)
    # the token check fails only where the model sampled a special token inside a turn, which the client never sees
    inside = set(tokenizer.all_special_ids) - set(engine.default_stop_ids)
    assert all(t.token_mismatch == 0 for t in trajectories
               if not inside & {i for i, m in zip(t.token_ids, t.response_mask) if m})


class GatedDriver(ScriptedDriver):
    """Scripted answers that arrive only once the test opens `gate`."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.gate = asyncio.Event()
        self.waiting: list[asyncio.Future] = []

    def _answer(self, seq: int) -> asyncio.Future:
        answer, future = super()._answer(seq).result(), asyncio.get_running_loop().create_future()

        async def later() -> None:
            await self.gate.wait()
            future.set_result(answer)

        self.waiting.append(asyncio.ensure_future(later()))
        return future


def test_a_request_waiting_for_the_concurrency_cap_counts_as_in_flight(tiny):
    """agent.max_concurrent_requests=1: the second trajectory's request waits for the first's. Its runner is
    waiting on the endpoint, not idle, so the lane counts it in flight (agent.timeout_s does not run for it)."""
    tokenizer, _ = tiny
    params = SamplingParams(temperature=1.0, max_tokens=8)

    async def main() -> None:
        driver = GatedDriver(tokenizer, ["One.", "Two."], tokenizer.eos_token_id)
        async with serving(tokenizer, driver, params, max_concurrent=1) as (endpoint, port):
            lanes = [endpoint.open(key) for key in ("a", "b")]
            asks = [asyncio.ensure_future(client(port, key).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "Count."}])) for key in ("a", "b")]
            # a request counts in flight on arrival and reaches the driver once rendered (off the event loop), so
            # wait for both; then the second, held by the cap, must not reach the driver while the first is open
            for _ in range(500):
                if sum(lane.in_flight for lane in lanes) == 2 and driver.calls:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert [lane.in_flight for lane in lanes] == [1, 1] and len(driver.calls) == 1  # one waits for the cap
            driver.gate.set()
            await asyncio.gather(*asks)
            assert [lane.in_flight for lane in lanes] == [0, 0] and len(driver.calls) == 2

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_the_concurrency_cap_does_not_hold_back_trajectories_that_hold_kv_slots(tiny_qwen2):
    """Two KV slots and agent.max_concurrent_requests=2. Trajectories a and b hold the slots between their turns;
    c and d's first requests take the cap's two places and wait for a slot. a and b's second requests continue
    what the engine holds, so they are served past the cap; then a and b end, and c and d get the slots (capped,
    a and b's requests would wait for c and d, and c and d for a and b's slots: forever)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    engine = RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=2, max_model_len=128)
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=4)
    question = [{"role": "user", "content": "Hi"}]

    async def main() -> list[int]:
        driver = engine_driver(engine, params)
        async with serving(tokenizer, driver, params, budget=64, max_concurrent=2) as (endpoint, port):
            lanes = {key: endpoint.open(key) for key in "abcd"}
            firsts = {key: await client(port, key).chat.completions.create(model="policy", messages=question)
                      for key in "ab"}
            waiting = [asyncio.ensure_future(client(port, key).chat.completions.create(model="policy",
                                                                                       messages=question))
                       for key in "cd"]
            while endpoint.active < 2:
                await asyncio.sleep(0.01)

            async def second_turn(key: str) -> None:
                follow = [*question, firsts[key].choices[0].message.model_dump(exclude_none=True),
                          {"role": "user", "content": "And?"}]
                await client(port, key).chat.completions.create(model="policy", messages=follow)
                lanes[key].end(driver.release)  # its runner returns

            await asyncio.gather(*(second_turn(key) for key in "ab"))
            await asyncio.gather(*waiting)
            return [lanes[key].finish(endpoint.renderers).turns for key in "abcd"]

    assert asyncio.run(asyncio.wait_for(main(), timeout=60)) == [2, 2, 1, 1]
