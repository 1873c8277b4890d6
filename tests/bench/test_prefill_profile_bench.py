"""`bench/prefill_profile.py` at a toy shape on the CPU: every prompt is prefilled, the runs are timed, and the JSON
holds the profiler's table of one run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import prefill_profile  # noqa: E402


def test_the_smoke_run_times_and_profiles_the_prefill(tmp_path, monkeypatch):
    out = tmp_path / "prefill.json"
    monkeypatch.setattr(sys, "argv", ["prefill_profile.py", "--device", "cpu", "--shape", "cpu-10m", "--batch", "3",
                                      "--prompt-len", "8", "--repeats", "2", "--rows", "5", "--out", str(out)])
    prefill_profile.main()
    report = json.loads(out.read_text())
    assert report["prompt_tokens"] == 24 and len(report["later_s"]) == 2 and report["tokens_per_s"] > 0
    assert report["engine_prefill_s"] > 0 and "aten::" in report["profile"]
