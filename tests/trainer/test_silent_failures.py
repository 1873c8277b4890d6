"""Nothing fails silently (issues 35 and 36), through `hybridflow train` on the tiny model: an environment
written as docs/agents.md shows runs on verl's multi-turn rows (their `interaction_kwargs` hold keys its
constructor does not take); an environment failing on every trajectory stops the run like a failing reward
(validation does not count) and the console shows the share of failures; a dataset with no ground truth
for a reward that reads it warns; data errors exit 2 with one line naming the file, row and column."""

from __future__ import annotations

import json
import logging
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rl_helpers import read_metrics

from hybridflow import cli
from hybridflow.trainer import rl

DOCS_ENVIRONMENT = """
    from hybridflow.agents import Environment, EnvStep

    class Feedback(Environment):
        def __init__(self, row, hint="Try again."):
            self.answer, self.hint = row["ground_truth"], hint

        def step(self, text, turn):
            return EnvStep(self.hint, reward=0.5)

    class Broken(Environment):
        def __init__(self, row, **kwargs):
            raise RuntimeError(f"no game for {kwargs['name']}")
"""


def verl_multiturn_rows(path, count=4):
    """Rows as verl's multi-turn GSM8K preprocessing writes them."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "data_source": "openai/gsm8k",
             "reward_model": {"ground_truth": str(2 * i)},
             "extra_info": {"index": i, "interaction_kwargs": {"name": "gsm8k", "query": f"What is {i} + {i}?",
                                                               "ground_truth": str(2 * i)}}}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cmd(model, data, out, *extra):
    return ["train", "--config", "recipes/grpo.yaml", f"model.path={model}", f"data.train_files={data}",
            "data.train_batch_size=2", "rollout.n=2", "data.max_prompt_length=64", "data.max_response_length=24",
            "actor.mini_batch_size=null", "reward.num_workers=0", f"trainer.output_dir={out}", *extra]


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "env.py"
    path.write_text(textwrap.dedent(DOCS_ENVIRONMENT))
    return path


def test_a_docs_environment_runs_on_verls_multiturn_rows(tiny_qwen2, tmp_path, env_file):
    out = tmp_path / "run"
    assert cli.main(cmd(tiny_qwen2, verl_multiturn_rows(tmp_path / "train.jsonl"), out, "trainer.total_steps=1",
                        "trainer.val_before_train=false", f"agent.environment={env_file}:Feedback",
                        "agent.max_turns=2", "agent.max_tokens_per_turn=4", "data.max_response_length=64",
                        "reward.function=environment")) == 0
    (metrics,) = read_metrics(out)
    assert metrics["agent/env_errors"] == 0 and metrics["agent/turns/mean"] == 2
    assert metrics["agent/env_reward/mean"] == 1.0  # both steps of every trajectory answered


def test_an_environment_failing_every_trajectory_stops_the_run(tiny_qwen2, tmp_path, env_file, capsys):
    data = verl_multiturn_rows(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    code = cli.main(cmd(tiny_qwen2, data, out, f"data.val_files={data}", "trainer.total_steps=5",
                        "trainer.val_every=0", f"agent.environment={env_file}:Broken", "agent.max_turns=2",
                        "reward.function=gsm8k", "reward.max_failed_steps=2"))
    captured = capsys.readouterr()
    assert code == 2
    # the validation before training failed on every trajectory too, and did not count
    assert f"hybridflow train: environment '{env_file}:Broken' failed on every trajectory of 2 training batches in " \
           f"a row (reward.max_failed_steps=2); the first error of the last one: making the environment failed: " \
           f"RuntimeError: no game for gsm8k\n" in captured.err
    assert [r["step"] for r in read_metrics(out) if "actor/pg_loss" in r] == [1]
    assert "| env errors 100%" in captured.out


def test_a_dataset_without_ground_truth_warns_when_the_reward_reads_it(tiny_qwen2, tmp_path, monkeypatch, caplog):
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "openai/gsm8k",
                                          "reward_model": {"answer": str(i)}} for i in range(4)]), data)
    monkeypatch.setattr(rl, "build_roles", lambda *a, **k: (_ for _ in ()).throw(SystemExit(9)))
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit):
        cli.main(cmd(tiny_qwen2, data, tmp_path / "run"))
    assert f"{data}: no row has a ground truth (reward_model.ground_truth or a ground_truth column); reward_model " \
           f"holds ['answer'], but reward function 'auto' reads ground_truth: it gets None on every row" in caplog.text


@pytest.mark.parametrize("row, expected", [
    ({"question": "q", "data_source": "openai/gsm8k"},
     "train.jsonl, row 1 (line 2): missing column 'prompt' (set data.prompt_key to the column holding it; columns: "
     "question, data_source)"),
    ({"prompt": [{"role": "user", "content": "q"}], "data_source": None},
     "train.jsonl, row 1 (line 2) (data_source is null or missing), column 'data_source': reward.function=auto has "
     "no reward for data_source 'unknown'"),
    ({"prompt": [{"role": "user", "content": "smile \ud83d please"}], "data_source": "openai/gsm8k"},
     "train.jsonl, row 1 (line 2), column 'prompt': the text holds a lone surrogate '\\ud83d' at character 6"),
])
def test_data_errors_exit_2_with_one_line_naming_file_row_and_column(tiny_qwen2, tmp_path, monkeypatch, capsys,
                                                                     row, expected):
    data = tmp_path / "train.jsonl"
    good = {"prompt": [{"role": "user", "content": "q"}], "data_source": "openai/gsm8k"}
    data.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    monkeypatch.setattr(rl, "build_roles", lambda *a, **k: pytest.fail("started workers before refusing"))
    assert cli.main(cmd(tiny_qwen2, data, tmp_path / "run", "data.train_batch_size=1")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hybridflow train: {data.parent}/") and expected in err and err.count("\n") == 1
