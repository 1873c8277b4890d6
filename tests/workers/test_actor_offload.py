"""`actor.param_offload` / `optimizer_offload`: the shards an update leaves serve the weight sync that follows it
without a round trip through the host, an update that no sync follows still hands them back before
generation, and a forward pass moves no optimizer state."""

from __future__ import annotations

import torch
from worker_helpers import actor_worker, rank_prompts, sampling

from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import ActorConfig, DataConfig, RolloutConfig
from hybridflow.controller.worker import WorkerContext
from hybridflow.workers import ActorWorker

RESP = 6
SAMPLING = sampling(2, RESP)


def _actor(path) -> ActorWorker:
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"), "actor", None)
    cfg = ActorConfig(lr=5e-3, mini_batch_size=3, micro_batch_size=6, param_offload=True, optimizer_offload=True)
    return actor_worker(ctx, ModelConfig(path=str(path), dtype="fp32"), cfg, RolloutConfig(n=2, cuda_graphs=False),
                        DataConfig(max_prompt_length=5, max_response_length=RESP))


def _record(actor: ActorWorker) -> list[tuple]:
    moves = []
    for name in ("offload", "onload"):
        real = getattr(actor.engine, name)

        def move(params=True, optimizer=True, real=real, name=name):
            moves.append((name, "params" if params else "-", "optimizer" if optimizer else "-"))
            real(params=params, optimizer=optimizer)
        setattr(actor.engine, name, move)
    return moves


def test_the_sync_after_an_update_uses_the_shards_the_update_left(tiny_qwen2):
    actor = _actor(tiny_qwen2)
    out = actor.generate(rank_prompts(0), SAMPLING)
    batch = out.union(actor.compute_log_probs(out, 1.0))
    batch["advantages"] = torch.randn(len(batch), RESP, generator=torch.Generator().manual_seed(0))
    moves = _record(actor)
    actor.update_actor(batch, 1.0)
    assert moves == [("onload", "params", "optimizer"), ("offload", "-", "optimizer")] and actor.params_on_device
    actor.sync_weights()
    assert moves[2:] == [("offload", "params", "-")] and not actor.params_on_device
    new = actor.generate(rank_prompts(0), SAMPLING)
    lp = actor.compute_log_probs(new, 1.0)  # the rollout has the trained weights
    assert float(((lp["old_log_probs"] - new["rollout_log_probs"]).abs() * new["response_mask"]).max()) < 1e-4

    del moves[:]
    actor.update_actor(batch, 1.0)
    actor.generate(rank_prompts(0), SAMPLING)  # no sync in between: the shards leave before the KV cache needs the room
    assert moves[-1] == ("offload", "params", "-") and not actor.params_on_device
    actor.update_actor(batch, 1.0)
    del moves[:]
    actor.compute_log_probs(new, 1.0)  # a forward needs the shards that are there and no optimizer state
    assert moves == [("offload", "params", "-")] and not actor.params_on_device
    del moves[:]
    actor.compute_log_probs(new, 1.0)
    assert moves == [("onload", "params", "-"), ("offload", "params", "-")]
