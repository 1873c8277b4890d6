"""`bench/learn_vs_trl.py --merge`: two `--only` runs (one device call each) make one race report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from learn_vs_trl import merge_reports  # noqa: E402

SETTINGS = {"device": "cuda", "prompts": 64, "n": 8, "budget_s": 450.0, "set": []}


def run(name: str, points: list[tuple[float, float]], **settings) -> dict:
    result = {"setup_s": 3.0, "points": [{"train_s": t, "accuracy": acc, "step": i * 5} for i, (t, acc) in
                                         enumerate(points)], "steps": []}
    return {"device": "H200", "commit": f"{name}-sha", "settings": {**SETTINGS, **settings},
            "summary": {}, "results": {name: result}}


def test_merged_runs_say_when_hybridflow_reached_trls_final_accuracy(tmp_path):
    ours = run("hybridflow", [(0, 0.10), (30, 0.18), (60, 0.41), (450, 0.85)])
    trl = run("trl", [(0, 0.10), (220, 0.30), (452, 0.40)])
    report = merge_reports([ours, trl])
    assert report["commit"] == ["hybridflow-sha", "trl-sha"] and set(report["results"]) == {"hybridflow", "trl"}
    assert report["summary"] == {"trl_final_accuracy": 0.40, "trl_final_train_s": 452,
                                 "hybridflow_train_s_to_trl_final": 60, "time_fraction": 60 / 452}
    assert report["results"]["hybridflow"]["final_accuracy"] == 0.85
    for name, r in (("ours.json", ours), ("trl.json", trl)):
        (tmp_path / name).write_text(json.dumps(r))
    out = tmp_path / "race.json"
    subprocess.run([sys.executable, str(BENCH / "learn_vs_trl.py"), "--merge", str(tmp_path / "ours.json"),
                    str(tmp_path / "trl.json"), "--out", str(out)], check=True, capture_output=True)
    assert json.loads(out.read_text())["summary"]["hybridflow_train_s_to_trl_final"] == 60
    assert out.with_suffix(".png").stat().st_size > 0


def test_runs_with_other_settings_or_the_same_framework_do_not_merge():
    ours = run("hybridflow", [(0, 0.1), (10, 0.2)])
    with pytest.raises(ValueError, match=r"budget_s \(450.0 against 300.0\)"):
        merge_reports([ours, run("trl", [(0, 0.1)], budget_s=300.0)])
    with pytest.raises(ValueError, match="one hybridflow run and one TRL run"):
        merge_reports([ours, run("hybridflow", [(0, 0.1)])])
