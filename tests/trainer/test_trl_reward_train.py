"""`hybridflow train` with TRL's reward functions (issue 36, item 8; issue 55): a batched function
``(prompts, completions, completion_ids, **kwargs) -> list[float]`` beside a verl-style one, weighted as
TRL's ``reward_funcs`` / ``reward_weights``, trains 2 steps on a TRL-shaped dataset (chat prompts and a
``solution`` column); an ``async def`` judge logging a metric and a function of ``completion_ids`` alone
train a step; a parameter no column fills is refused before any model loads. The functions are doubles
written here from TRL's and verl's public signatures."""

from __future__ import annotations

import json
import textwrap

import pytest
from rl_helpers import read_metrics

from hybridflow import cli
from hybridflow.trainer import rl

FUNCTIONS = """
    import json, os

    def matches_solution(prompts, completions, completion_ids, solution, **kwargs):
        with open(os.environ["TRL_CALLS"], "a") as log:
            log.write(json.dumps({"rows": len(completions), "chat": isinstance(completions[0], list),
                                  "prompt_is_chat": isinstance(prompts[0], list),
                                  "ids": all(isinstance(i, list) for i in completion_ids),
                                  "columns": sorted(kwargs)}) + "\\n")
        return [float(c[0]["content"].strip() == s) + len(c[0]["content"]) % 3 / 3 for c, s in zip(completions, solution)]

    def wants_answer(prompts, completions, answer, **kwargs):
        return [0.0 for _ in completions]

    def digits(data_source, solution_str, ground_truth, extra_info=None):
        return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)

    async def judge(prompts, completions, solution, log_metric, **kwargs):
        import asyncio
        await asyncio.sleep(0)  # an LLM judge's request
        log_metric("judge/agreement", 0.75)
        return [float(c[0]["content"].strip() == s) + len(c[0]["content"]) % 3 / 3 for c, s in zip(completions, solution)]

    def short(completion_ids, **kwargs):
        return [-0.01 * len(ids) for ids in completion_ids]
"""


def trl_rows(path, count=8):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i)}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_cmd(model, data, out, *extra):
    return ["train", "--config", "recipes/grpo.yaml", f"model.path={model}", f"data.train_files={data}",
            "data.train_batch_size=2", "rollout.n=2", "data.max_prompt_length=64", "data.max_response_length=6",
            "actor.mini_batch_size=null", "trainer.total_steps=2", "trainer.val_before_train=false",
            "reward.num_workers=1", f"trainer.output_dir={out}", *extra]


def test_trl_batched_and_verl_functions_with_weights_train_two_steps(tiny_qwen2, tmp_path, monkeypatch):
    funcs = tmp_path / "trl_rewards.py"
    funcs.write_text(textwrap.dedent(FUNCTIONS))
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRL_CALLS", str(calls))  # the spawned scoring process inherits it
    out = tmp_path / "run"
    assert cli.main(train_cmd(tiny_qwen2, trl_rows(tmp_path / "train.jsonl"), out,
                              f"reward.functions=[{funcs}:matches_solution,{funcs}:digits]",
                              "reward.weights=[1.0,0.5]")) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/errors"] == 0
        assert r["reward/mean"] == pytest.approx(r["reward/matches_solution/mean"] + 0.5 * r["reward/digits/mean"])
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(logged) == 2  # once per batch, not per row
    assert all(c["rows"] == 4 and c["chat"] and c["prompt_is_chat"] and c["ids"] for c in logged)
    assert logged[0]["columns"] == ["ability", "data_source", "extra_info", "ground_truth", "log_extra", "log_metric"]


def test_an_async_judge_and_a_completion_ids_function_train_and_verls_names_are_logged(tiny_qwen2, tmp_path, caplog):
    """TRL data has no ground truth and these functions need none: no warning. The judge's log_metric and
    verl's names of our metrics (critic/score/mean, val-core/<source>/reward/mean@1) reach metrics.jsonl."""
    funcs = tmp_path / "trl_rewards.py"
    funcs.write_text(textwrap.dedent(FUNCTIONS))
    data = trl_rows(tmp_path / "train.jsonl", count=4)
    out = tmp_path / "run"
    with caplog.at_level("WARNING"):
        assert cli.main(train_cmd(tiny_qwen2, data, out, f"reward.functions=[{funcs}:judge,{funcs}:short]",
                                  "trainer.total_steps=1", f"data.val_files={data}", "trainer.val_every=1")) == 0
    assert "no row has a ground truth" not in caplog.text
    (metrics,) = read_metrics(out)
    assert metrics["reward/errors"] == 0 and metrics["reward/judge/agreement"] == 0.75
    assert metrics["reward/mean"] == pytest.approx(metrics["reward/judge/mean"] + metrics["reward/short/mean"])
    assert metrics["reward/short/mean"] == pytest.approx(-0.01 * metrics["response_length/mean"])
    assert metrics["critic/score/mean"] == metrics["reward/mean"]
    assert metrics["critic/rewards/mean"] == metrics["reward/with_kl/mean"]
    (source,) = {k.split("/")[1] for k in metrics if k.startswith("val/") and k.endswith("/reward/mean")} - {"reward"}
    assert metrics[f"val-core/{source}/reward/mean@1"] == metrics[f"val/{source}/reward/mean"]


def test_a_batched_parameter_no_column_fills_is_refused_before_models_load(tiny_qwen2, tmp_path, monkeypatch, capsys):
    funcs = tmp_path / "trl_rewards.py"
    funcs.write_text(textwrap.dedent(FUNCTIONS))
    monkeypatch.setattr(rl, "build_roles", lambda *a, **k: pytest.fail("started workers before refusing"))
    assert cli.main(train_cmd(tiny_qwen2, trl_rows(tmp_path / "train.jsonl"), tmp_path / "run",
                              f"reward.function={funcs}:wants_answer")) == 2
    err = capsys.readouterr().err
    assert "reward function parameters ['wants_answer: answer'] name no column of " in err
    assert "train.jsonl (columns: solution); a batched function gets prompts, completions, completion_ids" in err
