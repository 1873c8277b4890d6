"""Multi-turn `hybridflow train` on CPU: an environment that answers each turn drives 3-turn trajectories,
and a tool-calling model calls the calculator; the batch the trainer sees (ids, masks, log-probs,
advantages, scores) and the `agent/...` metrics are checked."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.agents.loop.rendering import TurnRenderer
from hybridflow.config.loader import load_config
from hybridflow.trainer import step_math
from hybridflow.trainer.rl import train
from rl_helpers import read_metrics

ENVIRONMENT = """
    from hybridflow.agents import Environment, EnvStep

    class Coach(Environment):
        def step(self, text, turn):
            return EnvStep(f"{self.kwargs['word']} {turn}: try again.", reward=len(text) % 5 / 4)
"""


def write_rows(path, count, **extra_info):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "data_source": "toy",
             "reward_model": {"ground_truth": str(2 * i)}, "extra_info": {"index": i, **extra_info}}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def capture_batches(monkeypatch):
    """The step batches as the advantage computation gets them."""
    seen = []
    compute = step_math.compute_advantages

    def capturing(batch, cfg, facts):
        metrics = compute(batch, cfg, facts)
        seen.append(batch)
        return metrics

    monkeypatch.setattr(step_math, "compute_advantages", capturing)
    return seen


def overrides(model, data, out, *extra):
    return [f"model.path={model}", f"data.train_files={data}", "data.train_batch_size=2", "rollout.n=2",
            "data.max_prompt_length=128", "actor.lr=1e-4", "actor.mini_batch_size=null", "trainer.total_steps=1",
            "trainer.val_before_train=false", "reward.num_workers=1", f"trainer.output_dir={out}", *extra]


def test_environment_drives_three_turn_trajectories(tiny_qwen2, tmp_path, monkeypatch):
    env = tmp_path / "coach.py"
    env.write_text(textwrap.dedent(ENVIRONMENT))
    data = write_rows(tmp_path / "train.jsonl", 2, interaction_kwargs={"word": "Round"})
    seen = capture_batches(monkeypatch)
    train(load_config(overrides(tiny_qwen2, data, tmp_path / "out", f"agent.environment={env}:Coach",
                                "agent.env_kwargs={word: Attempt}", "agent.max_turns=3", "agent.max_tokens_per_turn=6",
                                "agent.timeout_s=5", "data.max_response_length=200", "reward.function=environment"),
                      "recipes/grpo.yaml"))
    (metrics,) = read_metrics(tmp_path / "out")
    assert metrics["agent/turns/mean"] == 3 and metrics["agent/turns/max"] == 3
    assert metrics["agent/env_errors"] == 0 and metrics["agent/cut_by_budget"] == 0
    assert metrics["agent/kv_reused_tokens"] > 0 and metrics["agent/env_seconds/mean"] > 0
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["agent/tool_calls/mean"] == 0

    (batch,) = seen
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    renderer = TurnRenderer(tokenizer)
    width = batch["responses"].shape[1]
    real = batch["attention_mask"][:, -width:].bool()
    assert len(batch) == 4
    for r in range(len(batch)):
        ids, mask = batch["responses"][r][real[r]].tolist(), batch["response_mask"][r][real[r]].tolist()
        stretches = [(i, mask[i]) for i in range(len(mask)) if i == 0 or mask[i] != mask[i - 1]] + [(len(mask), None)]
        assert [value for _, value in stretches[:-1]] == [1, 0, 1, 0, 1]  # model, env, model, env, model
        for turn, ((start, _), (end, _)) in enumerate(zip(stretches[1:-1:2], stretches[2::2])):
            model_turn = ids[:start]
            last = model_turn[-1] if model_turn[-1] == tokenizer.eos_token_id else None
            expected = renderer.render([{"role": "user", "content": f"Round {turn}: try again."}], last)
            assert ids[start:end] == expected  # the environment's ids, exactly as rendered, never re-tokenized
        model_turns = [stretches[i + 1][0] - stretches[i][0] for i in range(0, 5, 2)]
        assert all(1 <= n <= 6 for n in model_turns)  # agent.max_tokens_per_turn
        env_part = ~batch["response_mask"][r].bool() & real[r]
        assert batch["rollout_log_probs"][r][env_part].eq(0).all() and batch["advantages"][r][env_part].eq(0).all()
        assert batch["rollout_log_probs"][r][batch["response_mask"][r].bool()].lt(0).all()
        last_model = int(batch["response_mask"][r].nonzero().max())
        assert batch["token_scores"][r].nonzero().flatten().tolist() in ([last_model], [])
        info = batch["extra_info"][r]
        assert info["num_turns"] == 3 and info["interaction_kwargs"] == {"word": "Round"}
        assert batch["score"][r] == pytest.approx(info["env_reward"])
        assert [m["role"] for m in info["messages"]] == ["assistant", "user", "assistant", "user", "assistant"]
    assert "Round 1: try again." in batch["response_text"][0]  # rewards see the whole trajectory
    # trainer.log_rollouts (default 4): the step's rows token by token, turn by turn, for `hybridflow view`
    records = [json.loads(line) for line in (tmp_path / "out" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["step"] for r in records} == {1}
    for r, record in enumerate(records):
        n = int(real[r].sum())
        assert record["trained"] == batch["response_mask"][r][real[r]].tolist() and len(record["tokens"]) == n
        assert all(isinstance(t, str) for t in record["tokens"])
        assert record["advantage"] == pytest.approx(batch["advantages"][r][real[r]].tolist(), abs=1e-5)
        assert record["logprob"] == pytest.approx(batch["rollout_log_probs"][r][real[r]].tolist(), abs=1e-5)
        assert record["score"] == pytest.approx(batch["score"][r]) and record["staleness"] == [0] * n


def test_tool_calls_through_training(tool_calling_model, tmp_path, monkeypatch):
    data = write_rows(tmp_path / "train.jsonl", 4)
    seen = capture_batches(monkeypatch)
    train(load_config(overrides(tool_calling_model, data, tmp_path / "out", "agent.tools=[calculator]",
                                "agent.max_tool_calls=1", "agent.max_turns=4", "data.max_response_length=96",
                                "data.train_batch_size=4", "reward.function=environment"), "recipes/grpo.yaml"))
    (metrics,) = read_metrics(tmp_path / "out")
    assert 0 < metrics["agent/tool_calls/mean"] <= 1 and metrics["agent/turns/max"] <= 2
    (batch,) = seen
    tokenizer = AutoTokenizer.from_pretrained(tool_calling_model)
    prompt = tokenizer.decode(batch["prompts"][0]).replace("<|pad|>", "")
    assert prompt.startswith("<|im_start|>system\nTools: calculator")  # the template's tools= rendering
    answered = [info["messages"] for info in batch["extra_info"] if len(info["messages"]) > 1]
    assert answered
    assert all([m["role"] for m in messages] == ["assistant", "tool", "assistant"] for messages in answered)
    results = [messages[1]["content"] for messages in answered]
    assert "42" in results  # a well-formed call was run; a malformed one gets an error message
    assert all(r == "42" or r.startswith("Error:") for r in results)
    assert metrics["agent/tool_errors"] >= sum(r.startswith("Error:") for r in results)  # some never fit
    assert torch.equal(batch["response_mask"].sum(-1) < batch["attention_mask"][:, -96:].sum(-1),
                       torch.tensor([len(info["messages"]) > 1 for info in batch["extra_info"]]))


def test_feedback_retry_recipe_runs_and_its_environment_scores_attempts(tiny_qwen2, data_dir, tmp_path):
    from hybridflow.agents.loop.environment import load_environment

    retry = load_environment("recipes/environments/feedback_retry.py:FeedbackRetry")
    env = retry({"ground_truth": "18"}, decay=0.5)
    wrong = env.step("So the answer is 17.", 0)
    assert wrong.message.startswith("17 is not right") and wrong.reward == 0
    assert env.step("No number here.", 1).message.startswith("I could not find a final answer")
    right = env.step("Ah: 9 + 9 = 18.\n#### 18", 1)
    assert right.message is None and right.reward == 0.5

    train(load_config([f"model.path={tiny_qwen2}", f"data.train_files={data_dir}/train.parquet",
                       "data.train_batch_size=2", "rollout.n=2", "actor.mini_batch_size=null",
                       "data.max_prompt_length=256",
                       "data.max_response_length=400", "agent.max_tokens_per_turn=8", "trainer.total_steps=1",
                       "trainer.val_before_train=false", "trainer.save_every=0", "reward.num_workers=1",
                       f"trainer.output_dir={tmp_path / 'out'}"], "recipes/multiturn_retry.yaml"))
    (metrics,) = read_metrics(tmp_path / "out")
    assert metrics["agent/turns/max"] == 3 and metrics["agent/env_errors"] == 0  # a random model keeps retrying
    assert metrics["reward/mean"] == metrics["agent/env_reward/mean"]
