"""A LoRA actor on 1 and 2 gloo ranks (FSDP2 shards the frozen base weights and the adapters on 2): only the
adapters train and only they are in the optimizer (adamw, adamw_8bit, adamw_cpu_offload); the reference log-probs
are the base model's (the actor's own weights with the adapters disabled: no second model); the rollout engine
samples from the merged policy (its log-probs equal the trainer's after a sync, which sends only the adapted
modules' merged weights); a checkpoint (adapters + optimizer state) resumes exactly; a LoRA critic trains its
adapters and its new score head."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from train_helpers import rl_batch, run_ranks
from worker_helpers import actor_worker, masked_gap, rank_prompts, sampling

from hybridflow.batch import Batch
from hybridflow.config.model_schema import LoraConfig, ModelConfig
from hybridflow.config.schema import ActorConfig, CriticConfig, DataConfig, RolloutConfig
from hybridflow.controller.worker import WorkerContext
from hybridflow.engine.train import TrainEngine
from hybridflow.workers import ActorWorker, CriticWorker

N, RESP = 2, 6
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the default targets


def _actor(rank: int, world: int, path: str, optimizer: str = "adamw") -> ActorWorker:
    ctx = WorkerContext(rank, world, rank, torch.device("cpu"), "actor", None)
    actor_cfg = ActorConfig(lr=5e-2, mini_batch_size=1, micro_batch_size=2, kl_loss_coef=0.1, optimizer=optimizer,
                            lora=LoraConfig(rank=4, alpha=8))
    return actor_worker(ctx, ModelConfig(path=path, dtype="fp32"), actor_cfg,
                        RolloutConfig(n=N, temperature=1.0, cuda_graphs=False),
                        DataConfig(max_prompt_length=5, max_response_length=RESP), total_steps=4)


def _update(actor: ActorWorker, out: Batch, rank: int) -> dict[str, float]:
    batch = out.union(actor.compute_log_probs(out, 1.0)).union(actor.compute_ref_log_probs(out, 1.0))
    batch["advantages"] = torch.randn(len(batch), RESP, generator=torch.Generator().manual_seed(rank))
    return actor.update_actor(batch, 1.0)


def _ranks(rank, world, path, ckpt):
    actor = _actor(rank, world, path)
    engine = actor.engine
    res = {"ref_model": actor.ref, "sharded": engine.sharded}
    res["trained"] = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    res["dtensors"] = all(isinstance(p, DTensor) for p in engine.model.parameters())
    base = TrainEngine(ModelConfig(path=path, dtype="fp32"), None, head="lm")  # the model directory's policy

    out = actor.generate(rank_prompts(rank), sampling(N, RESP))
    mask = out["response_mask"]
    base_lp = base.infer(out.tensors)["log_probs"]
    first = actor.compute_log_probs(out, 1.0)["old_log_probs"]
    res["initial_vs_base"] = masked_gap(first, base_lp, mask)  # B starts at 0: the initial policy is the base model
    res["metrics"] = _update(actor, out, rank)
    res["ref_vs_base"] = masked_gap(actor.compute_ref_log_probs(out, 1.0)["ref_log_probs"], base_lp, mask)
    res["moved"] = masked_gap(actor.compute_log_probs(out, 1.0)["old_log_probs"], first, mask)

    stale = actor.generate(rank_prompts(rank), sampling(N, RESP))  # sampled before the sync: still the base model
    res["stale_gen_vs_logp"] = masked_gap(actor.compute_log_probs(stale, 1.0)["old_log_probs"], stale["rollout_log_probs"],
                                    stale["response_mask"])
    sent = []
    load = actor.rollout.engine.load_weights
    actor.rollout.engine.load_weights = lambda tensors: load((sent.append(n) or (n, t)) for n, t in tensors)
    storage = {n: p.data_ptr() for n, p in actor.rollout.engine.model.named_parameters()}
    res["sync"] = actor.sync_weights()
    res["sent"] = sent
    res["in_place"] = storage == {n: p.data_ptr() for n, p in actor.rollout.engine.model.named_parameters()}
    fresh = actor.generate(rank_prompts(rank), sampling(N, RESP))
    res["gen_vs_logp"] = masked_gap(actor.compute_log_probs(fresh, 1.0)["old_log_probs"], fresh["rollout_log_probs"],
                              fresh["response_mask"])

    actor.save_checkpoint(ckpt)
    resumed = _actor(rank, world, path)
    resumed.load_checkpoint(ckpt)
    res["resumed_vs_saved"] = masked_gap(resumed.compute_log_probs(out, 1.0)["old_log_probs"],
                                   actor.compute_log_probs(out, 1.0)["old_log_probs"], mask)
    after = [w.compute_log_probs(out, 1.0)["old_log_probs"] for w in (actor, resumed) if _update(w, out, rank)]
    res["next_step_resumed_vs_straight"] = masked_gap(after[0], after[1], mask)  # the optimizer state came back too
    return res


@pytest.mark.parametrize("world", [1, 2])
def test_lora_actor_trains_adapters_scores_the_base_and_samples_the_merged_policy(tiny_qwen2, tmp_path, world):
    for r in run_ranks(world, _ranks, world, str(tiny_qwen2), str(tmp_path / "actor")):
        assert r["ref_model"] is None and r["sharded"] == (world > 1) and r["dtensors"] == (world > 1)
        assert r["trained"] and all(".lora_A.default." in n or ".lora_B.default." in n for n in r["trained"])
        assert {n.split(".")[-4] for n in r["trained"]} == set(ADAPTED)
        assert r["initial_vs_base"] == 0.0 and r["ref_vs_base"] < 1e-6
        assert r["moved"] > 1e-2 and r["metrics"]["actor/kl_loss"] > 0
        assert r["stale_gen_vs_logp"] > 1e-2 and r["gen_vs_logp"] < 1e-4
        assert len(r["sent"]) == 2 * len(ADAPTED)  # 2 layers x the adapted modules; nothing else changed
        assert all(n.endswith(".weight") and n.split(".")[-2] in ADAPTED for n in r["sent"])
        assert r["sync"]["timing_s/update_weights"] > 0 and r["in_place"]  # CUDA graphs keep their pointers
        assert r["resumed_vs_saved"] == 0.0 and r["next_step_resumed_vs_straight"] == 0.0


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "adamw_cpu_offload"])
def test_only_the_adapters_are_in_the_optimizer(tiny_qwen2, optimizer):
    if optimizer == "adamw_8bit":
        pytest.importorskip("torchao")
    actor = _actor(0, 1, str(tiny_qwen2), optimizer)
    named = dict(actor.engine.model.named_parameters())
    in_optimizer = {id(p) for group in actor.engine.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in named.items() if ".lora_" in n}
    before = {n: p.detach().clone() for n, p in named.items()}
    _update(actor, actor.generate(rank_prompts(0), sampling(N, RESP)), 0)
    changed = {n for n, p in named.items() if not torch.equal(before[n], p.detach())}
    assert changed and all(".lora_B." in n or ".lora_A." in n for n in changed)
    assert all(not s or all(not torch.is_tensor(v) or v.device.type == "cpu" for v in s.values())
               for s in actor.engine.optimizer.state.values())


def test_lora_critic_trains_its_adapters_and_its_score_head(tiny_qwen2):
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"), "critic", None)
    cfg = CriticConfig(model=ModelConfig(path=str(tiny_qwen2), dtype="fp32"), lr=1e-2,
                       lora=LoraConfig(rank=2, target_modules=["q_proj", "v_proj"]))
    critic = CriticWorker.create(ctx, dict(config=CriticWorker.Config(model=cfg.model, critic=cfg)))
    trained = {n for n, p in critic.engine.model.named_parameters() if p.requires_grad}
    assert {n for n in trained if ".lora_" not in n} == {"score.weight", "score.bias"}
    assert {n.split(".")[-4] for n in trained if ".lora_" in n} == {"q_proj", "v_proj"}
    batch = Batch(rl_batch(rows=4, prompt_width=5, response_width=RESP, seed=2))
    batch = batch.union(critic.compute_values(batch))
    batch["returns"] = torch.ones(4, RESP)
    metrics = critic.update_critic(batch)
    assert metrics["critic/grad_norm"] > 0 and metrics["critic/vf_loss"] > 0
