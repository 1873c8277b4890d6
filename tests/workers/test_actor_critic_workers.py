"""Actor, reference and critic workers on a 2-process gloo group with tiny models: generate ->
compute_log_probs (matching the rollout's own log-probs, also after a weight sync) -> ref log-probs ->
update_actor (identical metrics on both ranks); critic from a different model directory."""

from __future__ import annotations

import torch
import torch.distributed as dist
from train_helpers import run_ranks
from worker_helpers import actor_worker, masked_gap, rank_prompts, sampling

from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import ActorConfig, CriticConfig, DataConfig, RLConfig, RolloutConfig
from hybridflow.controller.worker import WorkerContext
from hybridflow.trainer.role_configs import critic_config
from hybridflow.workers import CriticWorker

N = 2
RESP = 6


def _ranks(rank, actor_path, critic_path):
    ctx = WorkerContext(rank, 2, rank, torch.device("cpu"), "actor", None)
    model_cfg = ModelConfig(path=actor_path, dtype="fp32")
    actor_cfg = ActorConfig(lr=5e-3, mini_batch_size=1, micro_batch_size=2, kl_loss_coef=0.1,
                            optimizer_offload=True)
    rollout_cfg = RolloutConfig(n=N, temperature=1.0, cuda_graphs=False)
    data_cfg = DataConfig(max_prompt_length=5, max_response_length=RESP)
    actor = actor_worker(ctx, model_cfg, actor_cfg, rollout_cfg, data_cfg, total_steps=4)
    out = actor.generate(rank_prompts(rank), sampling(N, RESP))
    res = {"rows": len(out), "uid": list(out["uid"]), "shape": tuple(out["input_ids"].shape),
           "resp_tokens": float(out["response_mask"].sum())}
    lp = actor.compute_log_probs(out, 1.0)
    res["gen_vs_logp"] = masked_gap(lp["old_log_probs"], out["rollout_log_probs"], out["response_mask"])
    ref = actor.compute_ref_log_probs(out, 1.0)
    res["ref_vs_logp"] = masked_gap(lp["old_log_probs"], ref["ref_log_probs"], out["response_mask"])
    batch = out.union(lp).union(ref)
    batch["advantages"] = torch.randn(len(batch), RESP, generator=torch.Generator().manual_seed(rank))
    res["metrics"] = actor.update_actor(batch, 1.0)
    res["sync"] = actor.sync_weights()
    out2 = actor.generate(rank_prompts(rank), sampling(N, RESP))
    lp2 = actor.compute_log_probs(out2, 1.0)
    res["after_sync_gen_vs_logp"] = masked_gap(lp2["old_log_probs"], out2["rollout_log_probs"],
                                                   out2["response_mask"])
    res["moved"] = masked_gap(actor.compute_log_probs(out, 1.0)["old_log_probs"], lp["old_log_probs"],
                                  out["response_mask"])

    critic_cfg = CriticConfig(model=ModelConfig(path=critic_path, dtype="fp32"), lr=1e-3, micro_batch_size=1)
    critic = CriticWorker.create(ctx, dict(config=critic_config(
        RLConfig(model=model_cfg, critic=critic_cfg, rollout=rollout_cfg), total_steps=1)))
    values = critic.compute_values(batch)
    res["values_nonzero"] = float(values["values"].abs().sum())
    res["values_off_mask"] = float((values["values"] * (1 - batch["response_mask"])).abs().sum())
    batch = batch.union(values)
    batch["returns"] = torch.randn(len(batch), RESP, generator=torch.Generator().manual_seed(7))
    res["critic"] = critic.update_critic(batch)
    dist.barrier()
    return res


def test_actor_and_critic_workers_on_two_ranks(tiny_model_factory):
    actor_path = str(tiny_model_factory("qwen2"))
    critic_path = str(tiny_model_factory("llama", hidden=32))
    results = run_ranks(2, _ranks, actor_path, critic_path)
    for r in results:
        assert r["rows"] == 3 * N and r["shape"] == (3 * N, 5 + RESP)
        assert r["uid"][0] == r["uid"][1] != r["uid"][2]  # n samples per prompt, interleaved
        assert r["resp_tokens"] > 3 * N
        assert r["gen_vs_logp"] < 1e-4
        assert r["ref_vs_logp"] < 1e-6
        assert r["after_sync_gen_vs_logp"] < 1e-4  # the rollout got the trained weights
        assert r["moved"] > 1e-3  # and the update did change them
        m = r["metrics"]
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy",
                    "actor/grad_norm", "actor/lr", "actor/skipped_steps", "perf/throughput/actor"):
            assert key in m and m[key] == m[key], key
        assert m["actor/skipped_steps"] == 0 and m["actor/grad_norm"] > 0
        assert r["sync"]["timing_s/update_weights"] >= 0
        assert r["values_nonzero"] > 0 and r["values_off_mask"] == 0
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"):
            assert key in r["critic"], key
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/kl_loss"):
        assert results[0]["metrics"][key] == results[1]["metrics"][key], key
    assert results[0]["critic"]["critic/vf_loss"] == results[1]["critic"]["critic/vf_loss"]
