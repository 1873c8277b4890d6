"""`RolloutMismatch` inside the update loop on two gloo ranks: the mismatch metrics of rows spread over ranks
and micro-batches equal those of the whole batch at once (sums all-reduced, the max taken over ranks), and a
correction without `rollout_log_probs` is refused by name."""

from __future__ import annotations

import pytest
import torch
from train_helpers import model_cfg, optim_cfg, rl_batch, run_ranks

from hybridflow.algorithms import rollout_correction, training_rollout_mismatch
from hybridflow.config.schema import ActorConfig, RolloutCorrectionConfig
from hybridflow.engine.train import TrainEngine
from hybridflow.workers.mismatch import RolloutMismatch
from hybridflow.workers.update import actor_loss, run_update


def _batch():
    batch = rl_batch(rows=6, prompt_width=4, response_width=5, seed=3)
    g = torch.Generator().manual_seed(4)
    batch["advantages"] = torch.randn(6, 5, generator=g)
    batch["old_log_probs"] = -torch.rand(6, 5, generator=g) * 3
    batch["rollout_log_probs"] = batch["old_log_probs"] + 0.5 * torch.randn(6, 5, generator=g)
    return batch


def _ranks(rank, path):
    batch = _batch()
    rows = [0, 1, 2, 3] if rank == 0 else [4, 5]  # uneven shares; the largest gap may sit on either rank
    cfg = ActorConfig(lr=1e-3, micro_batch_size=1, rollout_correction=RolloutCorrectionConfig(mode="token_tis"))
    engine = TrainEngine(model_cfg(path), optim_cfg(), head="lm", total_steps=1)
    mismatch = RolloutMismatch(cfg.rollout_correction, engine.device)
    metrics = run_update(engine, {k: v[rows] for k, v in batch.items()}, cfg,
                         actor_loss(cfg, use_kl=False, use_entropy=False, mismatch=mismatch), passes=1,
                         prefix="actor")
    return {**metrics, **mismatch.metrics()}


def test_metrics_over_ranks_equal_the_whole_batch(tiny_qwen2):
    batch = _batch()
    whole = training_rollout_mismatch(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
    m0, m1 = run_ranks(2, _ranks, str(tiny_qwen2))
    for key, value in whole.items():
        assert m0[key] == pytest.approx(value, rel=1e-6) and m1[key] == m0[key], key
    _, corrected = rollout_correction("token_tis", batch["old_log_probs"], batch["rollout_log_probs"],
                                      batch["response_mask"])
    for key, value in corrected.items():  # token means of micro-batches, weighted by their tokens
        assert m0[f"rollout_corr/{key}"] == pytest.approx(float(value), rel=1e-6), key
    assert 0 < m0["rollout_corr/rollout_is_ratio_fraction_high"] < 1  # some ratios above 2 were truncated


def test_correction_needs_rollout_log_probs():
    mismatch = RolloutMismatch(RolloutCorrectionConfig(mode="seq_mis"), torch.device("cpu"))
    mb = {"advantages": torch.ones(1, 2), "response_mask": torch.ones(1, 2)}
    with pytest.raises(KeyError, match="actor.rollout_correction.mode=seq_mis needs `rollout_log_probs`"):
        mismatch.correct(torch.zeros(1, 2), mb)
    plain = RolloutMismatch(RolloutCorrectionConfig(), torch.device("cpu"))
    assert plain.correct(torch.zeros(1, 2), mb)[0] is mb["advantages"] and plain.metrics() == {}
