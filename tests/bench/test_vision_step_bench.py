"""`bench/vision_step.py` at a debug size on the CPU: the geo3k recipe trains every step it is asked for on the
bench's image rows, and the JSON holds each step's time, phases and generated tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import vision_step  # noqa: E402


def test_the_smoke_run_trains_its_steps_on_images(tmp_path, monkeypatch):
    out = tmp_path / "vision_step.json"
    monkeypatch.setattr(sys, "argv", ["vision_step.py", "--device", "cpu", "--shape", "tiny", "--prompts", "2",
                                      "--n", "2", "--new-tokens", "6", "--steps", "2", "--side", "56",
                                      "--out", str(out)])
    vision_step.main()
    report = json.loads(out.read_text())
    assert len(report["steps"]) == 2 and report["image_tokens"] == 4
    for step in report["steps"]:
        assert {"gen", "ref", "update_actor"} <= set(step["phases_s"]) and step["gen_tokens_per_s"] > 0
    assert report["first_step_s"] == report["steps"][0]["step_s"] > 0
