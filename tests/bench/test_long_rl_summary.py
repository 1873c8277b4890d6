"""`bench/long_rl.py`'s run figures from its steps: the response-length distribution and the run totals (response
tokens trained per second, generation-weighted GPU busy share, staleness), against hand-computed values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from long_rl import length_summary, totals  # noqa: E402


def test_length_summary_counts_the_tail_and_the_limit():
    lengths = [1, 3, 3, 100, 4096, 4096] + [50] * 94
    s = length_summary(lengths, 4096)
    assert s["count"] == 100 and s["max"] == 4096 and s["at_limit_share"] == 0.02 and s["p50"] == 50
    assert s["histogram"]["32-64"] == 94 and s["histogram"]["2048-4096"] == 2 and sum(s["histogram"].values()) == 100


def test_totals_weigh_the_busy_share_by_generation_time():
    steps = [{"timing_s/step": 2.0, "timing_s/gen": 1.0, "perf/gen/gpu_busy_share": 0.9, "response_tokens": 300,
              "rollout/staleness_mean": 0.5, "rollout/staleness_max": 1.0, "rollout/dropped": 2.0,
              "perf/gen/kv_read_tb_s": 2.0},
             {"timing_s/step": 4.0, "timing_s/gen": 3.0, "perf/gen/gpu_busy_share": 0.5, "response_tokens": 900,
              "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/dropped": 0.0,
              "perf/gen/kv_read_tb_s": 1.0}]
    t = totals(steps)
    assert t["response_tokens_per_s"] == 200.0 and t["gen_share_of_step"] == pytest.approx(4 / 6)
    assert t["gpu_busy_share"] == pytest.approx((0.9 * 1 + 0.5 * 3) / 4)
    assert t["kv_read_tb_s"] == pytest.approx((2.0 * 1 + 1.0 * 3) / 4)  # the bytes of both over their time
    assert t["staleness_mean"] == 0.25 and t["staleness_max"] == 1.0 and t["dropped"] == 2.0
    assert t["batch_occupancy"] is None  # no step reported it
    assert t["generated_tokens_per_s"] is None and t["trained_share_of_generated"] is None


def test_totals_count_what_generation_made_against_what_was_trained():
    steps = [{"timing_s/step": 2.0, "timing_s/gen": 1.0, "response_tokens": 300, "perf/gen/generated_tokens": 500.0,
              "perf/gen/mean_context": 100.0},
             {"timing_s/step": 4.0, "timing_s/gen": 3.0, "response_tokens": 900, "perf/gen/generated_tokens": 700.0,
              "perf/gen/mean_context": 1300.0}]
    t = totals(steps)
    assert t["generated_tokens_per_s"] == 300.0 and t["trained_share_of_generated"] == 1.0
    assert t["mean_context"] == pytest.approx((100 * 500 + 1300 * 700) / 1200)  # per token generated
    t = totals(steps[:1])
    assert t["generated_tokens_per_s"] == 500.0 and t["trained_share_of_generated"] == 0.6
