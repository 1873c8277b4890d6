"""`AgentLoop` on the real engine (tiny models, CPU): trajectories are the exact ids the engine sampled and
the ids appended for the environment, with the mask and log-probs the trainer needs; environments fail
without failing the run; a slow environment holds up no one; tools are called, limited and answered."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_helpers import agent_cfg
from hybridflow.agents import AgentLoop
from hybridflow.agents.tools.toolset import ToolSet
from hybridflow.batch import Batch
from hybridflow.data.chat import render_prompt
from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout.session import Session
from hybridflow.workers.rollout_layout import add_trajectory_fields, completions_to_batch

FEEDBACK = """
    from hybridflow.agents import Environment, EnvStep

    class Feedback(Environment):
        def step(self, text, turn):
            return EnvStep(f"{self.kwargs['word']} {turn}: try again.", reward=0.25)
"""


def prompts_for(tokenizer, questions, tools=None):
    texts = [render_prompt(q, tokenizer, tools=tools) for q in questions]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def rows_for(count, **extra_info):
    return [{"index": i, "raw_prompt": f"q{i}", "ground_truth": "42", "extra_info": dict(extra_info)}
            for i in range(count)]


def record_completions(monkeypatch):
    """seq -> the completions the session produced for it, in order."""
    produced: dict[int, list] = {}
    collect = Session.collect

    def recording(self, launched):
        done = collect(self, launched)
        for seq, completion in done:
            produced.setdefault(seq, []).append(completion)
        return done

    monkeypatch.setattr(Session, "collect", recording)
    return produced


def runs(mask):
    """[(start, end, value)] of the constant stretches of a 0/1 list."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_trajectories_are_the_engine_ids_and_the_appended_ids(tiny_qwen2, env_file, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    engine = RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=8, max_model_len=512)
    cfg = agent_cfg(environment=f"{env_file(FEEDBACK)}:Feedback", env_kwargs={"word": "Attempt"}, max_turns=3,
                    max_tokens_per_turn=6)
    loop = AgentLoop(cfg, tokenizer, budget=200)
    produced = record_completions(monkeypatch)
    prompts = prompts_for(tokenizer, ["What is 6 * 7?", "And 5 + 5?"])
    rows = rows_for(2)
    rows[1]["extra_info"]["interaction_kwargs"] = {"word": "Round"}  # verl's per-row environment arguments
    outs = loop.run(engine, prompts, rows, SamplingParams(n=2, temperature=1.0, seed=3))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    for seq, (prompt, trajectory) in enumerate((p, t) for p, row in zip(prompts, outs) for t in row):
        assert trajectory.turns == 3 and trajectory.env_reward == 0.75 and not trajectory.cut_by_budget
        stretches = runs(trajectory.response_mask)
        assert [v for _, _, v in stretches] == [1, 0, 1, 0, 1]
        word = "Round" if seq >= 2 else "Attempt"
        for turn, (start, end, _) in enumerate(stretches[::2]):  # model turns: exactly what the engine sampled
            completion = produced[seq][turn]
            assert trajectory.token_ids[start:end] == completion.token_ids
            assert trajectory.logprobs[start:end] == completion.logprobs
        for turn, (start, end, _) in enumerate(stretches[1::2]):  # environment turns: the rendered message
            last = produced[seq][turn]
            expected = loop.renderer.render([{"role": "user", "content": f"{word} {turn}: try again."}],
                                            last.token_ids[-1] if last.finish_reason == "stop" else None)
            assert trajectory.token_ids[start:end] == expected
            assert trajectory.logprobs[start:end] == [0.0] * (end - start)
        # one forward over prompt + all turns gives the log-probs the engine reported for its tokens
        with torch.no_grad():
            logits = model(torch.tensor([prompt + trajectory.token_ids])).logits[0, len(prompt) - 1:-1]
        full = logits.log_softmax(-1).gather(-1, torch.tensor(trajectory.token_ids)[:, None])[:, 0]
        mask = torch.tensor(trajectory.response_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(trajectory.logprobs)[mask], full[mask], atol=1e-4, rtol=0)
        assert [m["role"] for m in trajectory.messages] == ["assistant", "user"] * 2 + ["assistant"]
    reused = sum(t.kv_reused_tokens for row in outs for t in row)
    assert reused > 4 * 2 * len(prompts[0])  # every continuation reused its prompt and earlier turns

    # the trainer's rows: the same ids, mask and log-probs; attention over every real token
    prompt_part = {"prompts": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    batch = Batch(prompt_part, {"extra_info": [r["extra_info"] for r in rows]})
    out = completions_to_batch(batch, outs, 2, 200, pad_id=0)
    add_trajectory_fields(out, [t for row in outs for t in row])
    for r, trajectory in enumerate(t for row in outs for t in row):
        k = len(trajectory.token_ids)
        assert out["responses"][r, :k].tolist() == trajectory.token_ids and out["responses"][r, k:].eq(0).all()
        assert out["response_mask"][r, :k].tolist() == trajectory.response_mask
        assert out["rollout_log_probs"][r, :k].tolist() == trajectory.logprobs
        assert out["attention_mask"][r, 3:].tolist() == [1] * k + [0] * (200 - k)
        assert out["extra_info"][r]["num_turns"] == 3 and out["extra_info"][r]["env_reward"] == 0.75
        assert out["agent/turns"][r] == 3.0
    assert out["extra_info"][0] is not out["extra_info"][1]  # each sample its own dict


def test_environment_failures_end_their_trajectory_only(tiny_qwen2, env_file):
    source = """
        import asyncio
        from hybridflow.agents import EnvStep

        class Moody:
            def __init__(self, row, **kwargs):
                if row["index"] == 4:
                    raise RuntimeError("cannot start")
                self.index = row["index"]

            async def step(self, text, turn):
                if self.index == 1:
                    raise ValueError("broken environment")
                if self.index == 2:
                    await asyncio.sleep(60)
                if self.index == 3:
                    return 42
                return EnvStep("again")
    """
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    engine = RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=8, max_model_len=512)
    loop = AgentLoop(agent_cfg(environment=f"{env_file(source)}:Moody", max_turns=3, max_tokens_per_turn=4,
                               timeout_s=1.0), tokenizer, budget=120)
    start = time.perf_counter()
    outs = loop.run(engine, prompts_for(tokenizer, ["a", "b", "c", "d", "e"]), rows_for(5), SamplingParams(seed=0))
    assert time.perf_counter() - start < 30
    turns = [row[0].turns for row in outs]
    errors = [row[0].env_errors for row in outs]
    assert turns == [3, 1, 1, 1, 1] and errors == [0, 1, 1, 1, 1]  # 2 timed out, 3 answered a non-step
    assert outs[2][0].env_seconds >= 1.0


def test_a_slow_environment_holds_up_no_one(tiny_qwen2, env_file, tmp_path):
    source = """
        import time
        from hybridflow.agents import EnvStep

        class Slow:
            def __init__(self, row, log):
                self.index, self.log = row["index"], log

            def step(self, text, turn):      # sync: runs in a worker thread of the host process
                if self.index == 0 and turn == 0:
                    time.sleep(2.0)
                with open(self.log, "a") as f:
                    f.write(f"{self.index} {turn} {time.time()}\\n")
                return EnvStep("go on")
    """
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    engine = RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=8, max_model_len=512)
    log_file = tmp_path / "steps.log"
    loop = AgentLoop(agent_cfg(environment=f"{env_file(source)}:Slow", env_kwargs={"log": str(log_file)},
                               max_turns=4, max_tokens_per_turn=4), tokenizer, budget=150)
    outs = loop.run(engine, prompts_for(tokenizer, ["a", "b", "c"]), rows_for(3), SamplingParams(seed=0))
    log = [(int(i), int(turn), float(t)) for i, turn, t in map(str.split, log_file.read_text().splitlines())]
    slow_done = next(t for i, turn, t in log if i == 0 and turn == 0)
    others_done = max(t for i, turn, t in log if i != 0)
    assert others_done < slow_done  # the others finished all their turns while row 0 waited
    assert all(row[0].turns == 4 for row in outs)


def test_tools_are_called_limited_and_answered(tool_calling_model, env_file):
    source = """
        from hybridflow.agents import Tool, ToolResult

        class Secret(Tool):
            description = "Tells the row's secret."
            parameters = {"type": "object", "properties": {"expression": {"type": "string"}}}

            def call(self, arguments, context):
                context.state["calls"] = context.state.get("calls", 0) + 1
                return ToolResult(f"{context.kwargs['secret']} #{context.state['calls']}", reward=0.5)
    """
    tokenizer = AutoTokenizer.from_pretrained(tool_calling_model)
    engine = RolloutEngine.from_pretrained(tool_calling_model, max_num_seqs=8, max_model_len=1024)
    prompts = prompts_for(tokenizer, ["What is 6 * 7?", "Compute 6 times 7."], ToolSet(["calculator"]).schemas())
    assert tokenizer.decode(prompts[0]).startswith("<|im_start|>system\nTools: calculator<|im_end|>")
    greedy = SamplingParams(temperature=0.0)

    builtin = AgentLoop(agent_cfg(tools=["calculator"], max_turns=5, max_tool_calls=2), tokenizer, budget=400)
    for (trajectory,) in builtin.run(engine, prompts, rows_for(2), greedy):
        assert trajectory.tool_calls == 2 and trajectory.tool_errors == 0
        assert [m["role"] for m in trajectory.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["42", "42"]
        assert '<tool_call>{"name": "calculator"' in trajectory.messages[0]["content"]

    user_tool = {"name": "calculator", "class": f"{env_file(source)}:Secret"}  # the config renames it
    loop = AgentLoop(agent_cfg(tools=[user_tool], max_turns=3), tokenizer, budget=400)
    rows = rows_for(2, tools_kwargs={"calculator": {"secret": "s3"}})  # verl's per-row tool arguments
    for (trajectory,) in loop.run(engine, prompts, rows, greedy):
        assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["s3 #1", "s3 #2"]
        assert trajectory.env_reward == 1.0 and trajectory.turns == 3

    cut = AgentLoop(agent_cfg(tools=["calculator"], max_turns=5), tokenizer, budget=40)
    (trajectory,), _ = cut.run(engine, prompts, rows_for(2), greedy)
    assert trajectory.cut_by_budget and trajectory.finish_reason == "length" and len(trajectory.token_ids) <= 40


def test_a_huge_environment_message_cuts_the_episode_fast(tiny_qwen2, env_file):
    source = """
        class Flood:
            def __init__(self, row):
                pass

            def step(self, text, turn):
                return "flood " * 200_000
    """
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    engine = RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=8, max_model_len=512)
    loop = AgentLoop(agent_cfg(environment=f"{env_file(source)}:Flood", max_turns=3, max_tokens_per_turn=4),
                     tokenizer, budget=100)
    start = time.perf_counter()
    outs = loop.run(engine, prompts_for(tokenizer, ["a", "b", "c", "d"]), rows_for(4), SamplingParams(n=2, seed=0))
    assert time.perf_counter() - start < 15  # tokenizing the whole of each message took 5 s here
    assert all(t.cut_by_budget and t.turns == 1 for row in outs for t in row)
    loop.close()
