"""`bench/vision_learn.py` (issue 59's learning benchmark) end to end at a toy size: the warm-up lowers its loss, GRPO
runs through `hybridflow train` with validation on the held-out pictures, and the JSON holds the curve; its reward
names the color by the answer's first word."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import vision_learn  # noqa: E402


def test_the_reward_reads_the_first_word():
    assert vision_learn.reward("s", " Red. It is red", "red") == 1.0
    assert vision_learn.reward("s", "blue", "red") == 0.0 and vision_learn.reward("s", "", "red") == 0.0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_benchmark_runs_and_writes_its_curve(family, tmp_path, monkeypatch):
    out = tmp_path / "vision_learn.json"
    monkeypatch.setattr(sys, "argv", ["vision_learn.py", "--family", family, "--train-rows", "16", "--val-rows", "4",
                                      "--sft-steps", "3", "--sft-batch", "2", "--steps", "2", "--prompts", "2", "--n",
                                      "2", "--val-every", "1", "--out", str(out), "--plot", str(tmp_path / "c.png")])
    vision_learn.main()
    report = json.loads(out.read_text())
    assert report["family"] == family and report["sft_loss"][-1] < report["sft_loss"][0]
    assert [step for step, _ in report["val_reward"]] == [0, 1, 2]
    assert all(0.0 <= value <= 1.0 for _, value in report["val_reward"] + report["train_reward"])
    assert (tmp_path / "c.png").stat().st_size > 0
