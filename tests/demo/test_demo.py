"""The demo pipeline at a minuscule size (seconds): its files and summary, not its accuracy gain."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from hybridflow.demo import make_splits, run_demo, write_task_data
from hybridflow.demo.tasks import TASKS


def test_smoke_demo_writes_summary_metrics_tensorboard_and_report(tmp_path, capsys):
    summary = run_demo(tmp_path, "smoke")
    out = capsys.readouterr().out
    headers = [out.index(f"== demo {n}/4 ") for n in range(1, 5)]
    assert headers == sorted(headers) and out.index("== demo 2/4 SFT") < out.index("loss ") < headers[2]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    for key in ("accuracy_before_rl", "accuracy_after_rl"):
        assert 0.0 <= saved[key] <= 1.0
    assert saved["minutes"] > 0 and set(saved["minutes_by_phase"]) == {"data", "model", "sft", "rl", "report"}
    assert saved["minutes"] >= sum(saved["minutes_by_phase"].values()) - 0.01
    assert [step for step, _ in saved["validation_curve"]] == [0, 2]  # before RL and after its last step
    assert (tmp_path / "metrics.jsonl").is_file() and list((tmp_path / "tensorboard").glob("events.*"))
    assert saved["report"] == str(tmp_path / "report.html") and (tmp_path / "report.html").is_file()
    assert (tmp_path / "sft" / "hf" / "model.safetensors").is_file()
    sft_last = json.loads((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()[-1])
    assert sft_last["step"] == 2 and "train/loss" in sft_last


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_disjoint_and_answers_are_right(task):
    splits = make_splits(task, {"heldout": 50, "sft": 200, "rl": 100}, seed=3)
    questions = [q for problems in splits.values() for q, _ in problems]
    assert len(questions) == len(set(questions)) == 350
    for question, answer in splits["heldout"]:
        verb, arg = question.split(" ", 1)
        expected = {"reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s)),
                    "pick": lambda s: s.split()[1][int(s.split()[0]) - 1],
                    "add": lambda s: str(sum(map(int, s.split("+"))))}[verb](arg)
        assert verb == task and answer == expected


def test_task_files_feed_both_trainers(tmp_path):
    files = write_task_data(tmp_path, "reverse", n_sft=6, n_rl=4, n_heldout=3)
    sft = [json.loads(line) for line in files["sft"].read_text().splitlines()]
    assert len(sft) == 6 and [m["role"] for m in sft[0]["messages"]] == ["user", "assistant"]
    held = pq.read_table(files["heldout"]).to_pylist()
    assert len(held) == 3 and held[0]["reward_model"]["ground_truth"] == held[0]["prompt"][0]["content"][8:][::-1]
    assert not {row["prompt"][0]["content"] for row in held} & {r["messages"][0]["content"] for r in sft}


def test_too_small_a_task_space_is_refused():
    with pytest.raises(ValueError, match="too few distinct questions"):
        make_splits("reverse", {"heldout": 100, "sft": 1000}, min_len=1, max_len=1)


def test_a_new_run_removes_only_the_previous_demo_outputs(tmp_path):
    from hybridflow.demo.pipeline import _clear_previous

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val/reward/mean": 1.0}\n')
    (tmp_path / "sft" / "hf").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("mine")
    _clear_previous(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_sft_noise_echoes_the_input_in_that_share_of_demonstrations(tmp_path):
    from hybridflow.demo.tasks import echo_answer

    files = write_task_data(tmp_path, "reverse", n_sft=400, n_rl=4, n_heldout=4, sft_noise=0.5, min_len=4, max_len=6)
    rows = [json.loads(line)["messages"] for line in files["sft"].read_text().splitlines()]
    echoed = [m[1]["content"] == echo_answer(m[0]["content"]) for m in rows]
    right = [m[1]["content"] == m[0]["content"].split()[-1][::-1] for m in rows]
    assert 0.4 < sum(echoed) / len(rows) < 0.6
    assert all(e or r for e, r in zip(echoed, right))  # every answer is either the echo or the right one
    with pytest.raises(ValueError, match="sft_noise"):
        write_task_data(tmp_path, "reverse", n_sft=4, n_rl=4, n_heldout=4, sft_noise=1.0)
