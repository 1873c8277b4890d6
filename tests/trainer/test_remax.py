"""ReMax end to end: one greedy response per prompt beside the n samples, scored by the same reward; its score
is the baseline of the prompt's samples, and the greedy responses are not trained on."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.trainer import step_math
from rl_helpers import reward_file, run


@pytest.mark.parametrize("n", [1, 2])
def test_remax_baseline_is_the_greedy_responses_score(tiny_qwen2, data_dir, tmp_path, monkeypatch, engine_steps, n):
    seen = []
    apply_baselines, compute_advantages = step_math.apply_baselines, step_math.compute_advantages

    def spy_baselines(batch, greedy, result, cfg):
        seen.append({"greedy": greedy, "scores": list(result.scores)})
        return apply_baselines(batch, greedy, result, cfg)

    def spy_advantages(batch, cfg, facts):
        seen[-1]["batch"] = batch
        return compute_advantages(batch, cfg, facts)

    monkeypatch.setattr(step_math, "apply_baselines", spy_baselines)
    monkeypatch.setattr(step_math, "compute_advantages", spy_advantages)
    rows = run(tiny_qwen2, data_dir, tmp_path, "algorithm.adv_estimator=remax", f"rollout.n={n}",
               f"reward.function={reward_file(tmp_path)}", "trainer.val_before_train=false", "trainer.val_every=0")
    assert [r["step"] for r in rows] == [1, 2] and len(seen) == 2
    for step, row in zip(seen, rows):
        greedy, batch = step["greedy"], step["batch"]
        assert len(greedy) == 2  # one greedy response per prompt
        assert list(batch["uid"]) == [u for u in greedy["uid"] for _ in range(n)]
        baselines = torch.tensor(step["scores"]).repeat_interleave(n)
        assert torch.equal(batch["baselines"], baselines)
        scores = batch["token_scores"].sum(-1)
        expected = (scores - baselines)[:, None] * batch["response_mask"]
        assert torch.allclose(batch["advantages"], expected, atol=1e-6)
        assert row["reward/baseline/mean"] == pytest.approx(sum(step["scores"]) / 2, rel=1e-5)
        assert row["timing_s/gen_baseline"] > 0 and math.isfinite(row["actor/grad_norm"])
    # only the 2 x n samples are trained on (one optimizer step per trainer step), never the greedy rows
    assert [s["rows"] for s in engine_steps["lm"]] == [2 * n, 2 * n]
    assert all(s["grad_norm"] > 0 and s["changed"] for s in engine_steps["lm"])
