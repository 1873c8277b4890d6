"""GRPO on a tiny mixture of experts (Qwen3-MoE; OLMoE; Qwen3-Next, hybrid) through `hybridflow train`: LoRA on the attention and on
the routed experts, routes recorded by the rollout engine and replayed in the trainer's forwards, the router aux
loss; and the config checks of the MoE keys."""

from __future__ import annotations

import pytest

from hybridflow.config.loader import load_config
from hybridflow.config.validate import ConfigError, validate
from rl_helpers import base_overrides, reward_file, run

MOE = ("actor.lora.rank=4", "actor.lora.alpha=8",
       "actor.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]", "rollout.record_routes=true",
       "trainer.val_before_train=false", "trainer.val_every=0", "reward.num_workers=0", "trainer.loggers=[jsonl]",
       "actor.lr=1e-2")


@pytest.fixture(scope="module")
def moe_model(tiny_model_factory):
    return tiny_model_factory("qwen3_moe", experts=8, experts_per_token=2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "qwen3_next"])
def test_lora_grpo_with_router_replay_trains(tiny_model_factory, data_dir, tmp_path, arch):
    model = tiny_model_factory(arch, experts=8, experts_per_token=2)
    rows = run(model, data_dir, tmp_path / "run", *MOE, "actor.router_replay=rollout",
               "actor.router_aux_loss_coef=0.01", "actor.kl_loss_coef=0.01", f"reward.function={reward_file(tmp_path)}")
    assert len(rows) == 2
    for row in rows:
        assert row["router/agreement"] == 1.0 and row["router/token_agreement"] == 1.0
        assert row["router/aux_loss"] > 0 and row["actor/grad_norm"] > 0
        assert row["rollout_corr/k3_kl"] < 1e-6  # the engine sampled from the trained policy, routes and all


def test_expert_lora_with_replay_trains_on_two_fsdp2_ranks(moe_model, data_dir, tmp_path):
    # each rank holds shards of the stacked experts and their adapters; the weight sync gathers and merges them
    rows = run(moe_model, data_dir, tmp_path / "run", *MOE, "actor.router_replay=rollout", "trainer.n_workers=2",
               f"reward.function={reward_file(tmp_path)}")
    assert len(rows) == 2 and all(row["router/agreement"] == 1.0 and row["actor/grad_norm"] > 0 for row in rows)
    # step 2 samples from the weights step 1 updated at lr 1e-2: the engine got the merged experts
    assert rows[1]["rollout_corr/k3_kl"] < 1e-6


def test_router_statistics_without_replay(moe_model, data_dir, tmp_path):
    rows = run(moe_model, data_dir, tmp_path / "run", *MOE, f"reward.function={reward_file(tmp_path)}")
    for row in rows:
        assert row["router/agreement"] == row["router/topk_agreement"] > 0.9  # fp32 on a CPU: the same routes
        assert "router/aux_loss" not in row


def test_moe_keys_are_checked(moe_model, tiny_qwen2, data_dir, tmp_path):
    def problems(model, *extra):
        with pytest.raises(ConfigError) as err:
            validate(load_config(base_overrides(model, data_dir, tmp_path, *extra), "recipes/grpo.yaml"))
        return str(err.value)

    assert "set rollout.record_routes=true" in problems(moe_model, "actor.router_replay=rollout",
                                                        "rollout.record_routes=false")
    assert "needs the fast engine" in problems(moe_model, "rollout.record_routes=true", "rollout.engine=hf")
    assert "need a mixture of experts" in problems(tiny_qwen2, "rollout.record_routes=true")
    assert "actor.lora.target_parameters: 'experts.gate': no parameter has that name" in problems(
        moe_model, "actor.lora.rank=4", "actor.lora.target_parameters=[experts.gate]")
    assert "actor.lora.dropout=0.1 cannot apply to expert weights" in problems(
        moe_model, "actor.lora.rank=4", "actor.lora.dropout=0.1", "actor.lora.target_parameters=[experts.down_proj]")
