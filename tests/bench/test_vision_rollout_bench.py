"""`bench/vision_rollout.py` at a debug size on the CPU: both sides generate every row's tokens from the same
prompts and images, and the JSON holds their rates and the ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import vision_rollout  # noqa: E402


def test_the_smoke_run_generates_every_row_on_both_sides(tmp_path, monkeypatch):
    out = tmp_path / "vision_rollout.json"
    monkeypatch.setattr(sys, "argv", ["vision_rollout.py", "--device", "cpu", "--shape", "tiny", "--prompts", "2",
                                      "--n", "2", "--new-tokens", "6", "--side", "112", "--out", str(out)])
    vision_rollout.main()
    report = json.loads(out.read_text())
    assert report["rows"] == 4 and report["ours"]["tokens"] == report["generate"]["tokens"] == 4 * 6
    assert report["speedup"] == report["ours"]["tok_s"] / report["generate"]["tok_s"] > 0
