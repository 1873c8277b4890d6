"""The shared update loop: mini-batches per step follow mini_batch_size x n over all ranks, and a rank
whose share of a mini-batch is empty still joins the step (same metrics everywhere)."""

from __future__ import annotations

import torch
from train_helpers import model_cfg, optim_cfg, rl_batch, run_ranks

from hybridflow.config.schema import ActorConfig
from hybridflow.engine.train import TrainEngine
from hybridflow.workers.update import actor_loss, run_update


def _ranks(rank, path):
    batch = rl_batch(rows=4, prompt_width=4, response_width=5, seed=11)
    batch["advantages"] = torch.randn(4, 5, generator=torch.Generator().manual_seed(12))
    rows = [0, 1, 2] if rank == 0 else [3]  # 4 rows; 2 steps of 2 rows: rank 1 has none in one of them
    local = {k: v[rows] for k, v in batch.items()}
    cfg = ActorConfig(lr=1e-3, mini_batch_size=1, micro_batch_size=1)
    engine = TrainEngine(model_cfg(path), optim_cfg(), head="lm", total_steps=2, pack_on_cpu=True)
    metrics = run_update(engine, local, cfg, actor_loss(cfg, use_kl=False, use_entropy=False), passes=1,
                         prefix="actor", mini_batch_rows=cfg.mini_batch_size * 2)
    return metrics, engine.scheduler.last_epoch


def test_empty_share_of_a_mini_batch_still_steps(tiny_qwen2):
    (m0, steps0), (m1, steps1) = run_ranks(2, _ranks, str(tiny_qwen2))
    assert steps0 == steps1 == 2  # global 4 rows / (1 prompt x 2 samples) = 2 optimizer steps
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/lr"):
        assert m0[key] == m1[key], key
    assert m0["actor/grad_norm"] > 0 and m0["actor/skipped_steps"] == 0
