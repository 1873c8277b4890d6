"""`bench/partial_sim.py`: the real in-flight buffer over an engine double with long-tailed lengths. A synchronous
step trains on-policy samples only; partial rollouts keep the staleness bound, and with
`rollout.partial_stale=finish` and no more extra batches than the bound they drop nothing where `drop` does."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from partial_sim import Cost, length_sampler, simulate  # noqa: E402

# lengths like the H200 run's: most short, a fifth at the limit
RUN = {"limit": 256, "lengths": {"count": 100, "at_limit_share": 0.2,
                                 "histogram": {"0-16": 0, "16-32": 40, "32-64": 30, "64-128": 10, "128-256": 20}}}


def run(setting):
    return simulate(setting, RUN, Cost(), budget_s=10.0, prompts=4, n=4, slots=16, seed=0)


def test_lengths_follow_the_histogram():
    import random

    draw = length_sampler(RUN, random.Random(0))
    lengths = [draw() for _ in range(4000)]
    assert 0.17 < sum(x == 256 for x in lengths) / len(lengths) < 0.23
    assert min(lengths) >= 16 and max(lengths) == 256


def test_sync_partial_drop_and_finish():
    sync = run({"mode": "sync"})
    assert sync["steps"] > 3 and sync["staleness_mean"] == 0 and sync["dropped"] == 0
    drop = run({"mode": "partial", "stale": "drop", "max_staleness": 1, "extra_batches": 1})
    finish = run({"mode": "partial", "stale": "finish", "max_staleness": 1, "extra_batches": 1})
    assert drop["dropped"] > 0 and finish["dropped"] == 0 and finish["stale_finished"] > 0
    for r in (drop, finish):
        assert r["steps"] > 3 and 0 < r["staleness_mean"] <= 1


def test_rows_that_read_their_context_leave_partial_rollouts_little_to_gain():
    """Where a decode step costs the same for any number of rows, filling the slots pays; where each row's
    cost is its context read from the KV cache (a long decode of a small model), it hardly does."""
    def gain(cost):
        sync = simulate({"mode": "sync"}, RUN, cost, budget_s=20.0, prompts=4, n=4, slots=16, seed=0)
        partial = simulate({"mode": "partial", "stale": "finish", "max_staleness": 2, "extra_batches": 2}, RUN, cost,
                           budget_s=20.0, prompts=4, n=4, slots=16, seed=0)
        return partial["response_tokens_per_s"] / sync["response_tokens_per_s"]

    per_step = gain(Cost(decode_ms=1.75, row_us=0.0, context_ns=0.0, update_s=0.05, update_us_per_token=8.0))
    per_context = gain(Cost(decode_ms=0.0, row_us=0.0, context_ns=2000.0, update_s=0.05, update_us_per_token=8.0))
    assert per_step > 1.2 and per_context < 1.1, (per_step, per_context)
