"""`RolloutWorker` on its own processes, fed by a 2-rank FSDP actor over the gloo weight-sync group: after
an update and a sync its greedy outputs are those of the actor's current weights (and not the stale
ones); the bucket plan bounds each bucket and keeps the parameter order."""

from __future__ import annotations

import torch

from hybridflow.batch import Batch
from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import ActorConfig, DataConfig, RLConfig, RolloutConfig
from hybridflow.controller import WorkerGroup
from hybridflow.engine.contracts import RolloutEngineContract
from hybridflow.engine.rollout import SamplingParams
from hybridflow.trainer.role_configs import actor_config, rollout_worker_config
from hybridflow.trainer.role_groups import SeparateRollout
from hybridflow.workers import ActorWorker, RolloutWorker
from hybridflow.workers.weight_sync import plan_buckets

RESP = 6


def _sampling(temperature: float) -> SamplingParams:
    return SamplingParams(n=1 if temperature == 0 else 2, temperature=temperature, max_tokens=RESP, seed=3)


def _prompts() -> Batch:
    g = torch.Generator().manual_seed(5)
    prompts = torch.zeros(4, 5, dtype=torch.long)
    mask = torch.zeros(4, 5, dtype=torch.long)
    for i, length in enumerate((5, 3, 2, 4)):
        prompts[i, 5 - length:] = torch.randint(4, 250, (length,), generator=g)
        mask[i, 5 - length:] = 1
    return Batch({"prompts": prompts, "attention_mask": mask}, {"uid": [f"p{i}" for i in range(4)]})


def test_plan_buckets_bounds_each_bucket_and_keeps_the_order():
    shapes = [("a", (10,)), ("b", (3, 2)), ("big", (40,)), ("c", (5,)), ("d", (6,))]
    plan = plan_buckets(shapes, torch.float32, bucket_bytes=64)  # 16 floats per bucket
    assert [[name for name, _ in bucket] for bucket in plan] == [["a", "b"], ["big"], ["c", "d"]]
    assert [p for bucket in plan for p in bucket] == shapes
    assert len(plan_buckets(shapes, torch.bfloat16, bucket_bytes=1 << 20)) == 1


def test_separate_rollout_generates_with_the_synced_weights(tiny_qwen2):
    model_cfg = ModelConfig(path=str(tiny_qwen2), dtype="fp32")
    rollout_cfg = RolloutConfig(n=2, temperature=1.0, cuda_graphs=False)
    data_cfg = DataConfig(max_prompt_length=5, max_response_length=RESP)
    cfg = RLConfig(model=model_cfg, actor=ActorConfig(lr=0.05, micro_batch_size=4), rollout=rollout_cfg,
                   data=data_cfg)
    actor_kwargs = dict(config=actor_config(cfg, total_steps=1))  # colocated: it has an engine of its own too
    with WorkerGroup(ActorWorker, n_workers=2, name="actor", init_kwargs=actor_kwargs) as actor, \
            WorkerGroup(RolloutWorker, n_workers=2, name="rollout",
                        init_kwargs=dict(config=rollout_worker_config(cfg))) as rollout:
        sync = SeparateRollout(actor, rollout, bucket_bytes=16 << 10)  # several buckets, one per big matrix
        prompts, greedy = _prompts(), _sampling(0.0)
        before = rollout.generate(prompts, greedy)
        batch = rollout.generate(prompts, _sampling(1.0))
        batch = batch.union(actor.compute_log_probs(batch, 1.0))
        batch["advantages"] = torch.randn(len(batch), RESP, generator=torch.Generator().manual_seed(0))
        actor.update_actor(batch, 1.0)
        stale = rollout.generate(prompts, greedy)
        timing = sync.sync_weights()
        got = rollout.generate(prompts, greedy)
        actor.sync_weights()  # the actor's own engine, fed in place from the same weights
        expected = actor.generate(prompts, greedy)
        trained = actor.compute_log_probs(got, 0.0)["old_log_probs"]

    mask = got["response_mask"]
    assert torch.equal(stale["responses"], before["responses"])  # nothing moves before the sync
    assert torch.equal(got["responses"], expected["responses"])
    assert torch.allclose(got["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-5)
    assert float(((got["rollout_log_probs"] - trained).abs() * mask).max()) < 1e-4  # = the trainer's weights
    moved = ((stale["rollout_log_probs"] - got["rollout_log_probs"]).abs() * mask).max()
    assert float(moved) > 1e-3  # the update changed the weights, and the sync delivered the change
    assert timing["timing_s/update_weights"] > 0


class _GPUEngineStub:
    """A rollout engine on an accelerator, written from the contract (`RolloutEngineContract`), recording the
    sleep/wake calls a replica makes on it."""

    kind = "fast"
    device = torch.device("cuda")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stats: dict[str, float] = {}

    def sleep(self, offload_weights: bool = False) -> None:
        self.calls.append("sleep, weights to the CPU" if offload_weights else "sleep")

    def wake(self) -> None:
        self.calls.append("wake")

    def generate(self, prompts, params):
        from hybridflow.engine.rollout import Completion

        return [[Completion([7, 8], [-0.5, -0.25], "stop") for _ in range(params.n)] for _ in prompts]

    def load_weights(self, named_tensors) -> int:
        return len(list(named_tensors))


def _replica(monkeypatch, engine: RolloutEngineContract, rollout: RolloutConfig):
    from hybridflow.workers import rollout_replica

    monkeypatch.setattr(rollout_replica, "build_rollout", lambda *args, **kwargs: engine)
    config = rollout_replica.RolloutReplica.Config(model_path="unused", rollout=rollout, max_prompt_length=5,
                                                   max_response_length=RESP)
    return rollout_replica.RolloutReplica(config, torch.device("cuda"), torch.float32, pad_id=0)


def test_free_cache_after_generate_frees_the_cache_after_each_generation_or_never(monkeypatch):
    for free, expected in ((True, ["sleep", "wake", "sleep"]), (False, [])):
        engine = _GPUEngineStub()
        replica = _replica(monkeypatch, engine, RolloutConfig(free_cache_after_generate=free))
        out = replica.generate(_prompts(), _sampling(1.0), step=0, rank=0)
        assert len(out) == 8 and out["response_mask"].sum() == 16
        assert engine.calls == expected and replica.awake == (not free)


def test_offload_weights_moves_the_rollout_weights_out_whenever_the_engine_sleeps(monkeypatch):
    engine = _GPUEngineStub()
    replica = _replica(monkeypatch, engine, RolloutConfig(offload_weights=True))
    replica.generate(_prompts(), _sampling(1.0), step=0, rank=0)
    assert engine.calls == ["sleep, weights to the CPU", "wake", "sleep, weights to the CPU"]


def test_a_cpu_kv_cache_holds_one_training_step_of_rows_not_max_num_seqs(tiny_qwen2):
    from hybridflow.workers.rollout_replica import build_rollout

    # sized by max_num_seqs alone, a real model's zero-filled CPU cache took most of the machine's RAM
    engine = build_rollout(str(tiny_qwen2), RolloutConfig(max_num_seqs=256), torch.device("cpu"), torch.float32,
                           64, rows_in_flight=6)
    assert engine.kv.num_slots == 6
    out = engine.generate([[5, 6, 7]] * 4, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=0))
    assert [len(row) for row in out] == [3] * 4  # 12 rows through 6 slots: the rest queue


def test_the_plans_prefill_forward_reaches_the_engine(tiny_qwen2):
    """A device plan that shrank the prefill forwards to leave the KV cache more slots (`DevicePlan.max_prefill_tokens`)
    builds the engine with them; without one the engine keeps its default."""
    from hybridflow.engine.rollout.engine import MAX_PREFILL_TOKENS
    from hybridflow.workers.rollout_replica import build_rollout

    shrunk = build_rollout(str(tiny_qwen2), RolloutConfig(), torch.device("cpu"), torch.float32, 64,
                           rows_in_flight=4, max_prefill_tokens=2048)
    kept = build_rollout(str(tiny_qwen2), RolloutConfig(), torch.device("cpu"), torch.float32, 64, rows_in_flight=4)
    assert shrunk.max_prefill_tokens == 2048 and kept.max_prefill_tokens == MAX_PREFILL_TOKENS == 16384
