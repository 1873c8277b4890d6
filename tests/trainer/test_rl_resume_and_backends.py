"""Exact resume of an RL run, and the same run giving the same metrics on the local and Ray backends."""

from __future__ import annotations

import importlib.util
import math

import pytest

from rl_helpers import TWO_WORKERS, run

# Timings, throughput and memory differ between any two runs; everything else must match.
NONDETERMINISTIC = ("timing_s/", "timing_per_token_ms/", "perf/")


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)}


def assert_same_metrics(a: dict, b: dict, rel: float = 1e-5) -> None:
    a, b = comparable(a), comparable(b)
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], float) and math.isnan(a[key]):
            assert math.isnan(b[key]), key
        else:
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-7), key


def test_resume_continues_exactly(tiny_qwen2, data_dir, tmp_path):
    common = ("trainer.val_before_train=false", "trainer.val_every=0", "trainer.total_steps=4")
    straight = run(tiny_qwen2, data_dir, tmp_path / "straight", *common)
    run(tiny_qwen2, data_dir, tmp_path / "resumed", *common[:-1], "trainer.total_steps=2")
    resumed = run(tiny_qwen2, data_dir, tmp_path / "resumed", *common)  # resume=auto picks step 2
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # the first run's lines are kept, then 3 and 4
    for step in (3, 4):
        assert_same_metrics(straight[step - 1], resumed[step - 1])


@pytest.mark.ray
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_local_and_ray_backends_give_the_same_metrics(tiny_qwen2, data_dir, tmp_path, monkeypatch,
                                                     local_two_workers):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    local = local_two_workers
    ray = run(tiny_qwen2, data_dir, tmp_path / "ray", *TWO_WORKERS, "trainer.backend=ray")
    assert len(local) == len(ray) == 2
    for a, b in zip(local, ray):
        assert_same_metrics(a, b)


def test_resume_with_fewer_workers_reshards(tiny_qwen2, data_dir, tmp_path):
    common = ("trainer.val_before_train=false", "trainer.val_every=0")
    run(tiny_qwen2, data_dir, tmp_path, *common, "trainer.n_workers=2", "trainer.total_steps=1")
    rows = run(tiny_qwen2, data_dir, tmp_path, *common, "trainer.n_workers=1", "trainer.total_steps=2")
    assert [r["step"] for r in rows] == [1, 2]
    assert math.isfinite(rows[-1]["actor/grad_norm"]) and math.isfinite(rows[-1]["actor/pg_loss"])
