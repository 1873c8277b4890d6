"""`resolve_facts`: what an RL config implies, decided once on the controller and handed to the workers."""

from __future__ import annotations

from hybridflow.config.loader import load_config
from hybridflow.config.resolved import resolve_facts


def test_grpo_defaults_skip_the_old_log_probs_and_need_no_critic_or_reference():
    facts = resolve_facts(load_config(["data.train_batch_size=4", "rollout.n=3"]))  # the schema defaults: GRPO
    assert not facts.critic and not facts.reference and not facts.reference_copy and not facts.greedy_baseline
    assert facts.skip_old_log_probs and facts.step_rows == 12 and facts.groups == {"actor": 1}
    assert not facts.separate_rollout and not facts.agent and not facts.teacher and facts.task_advantage
    assert facts.rows_in_flight == 12 and facts.rollout_ranks == 1 and not facts.off_policy


def test_mini_batch_rows_are_prompts_times_n_and_several_mini_batches_need_old_log_probs():
    facts = resolve_facts(load_config(["data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=2",
                                       "critic.mini_batch_size=4"], "recipes/ppo.yaml"))
    assert facts.actor_mini_batch_rows == 8 and facts.critic_mini_batch_rows == 16
    assert facts.critic and not facts.skip_old_log_probs


def test_a_lora_actor_needs_a_reference_but_holds_no_copy():
    for rank, copy in ((0, True), (4, False)):
        facts = resolve_facts(load_config(["actor.kl_loss_coef=0.1", f"actor.lora.rank={rank}"]))
        assert facts.reference and facts.reference_copy == copy and facts.actor_lora == (rank > 0)


def test_placements_and_groups():
    facts = resolve_facts(load_config(["algorithm.adv_estimator=gae", "trainer.placement=split",
                                       "rollout.placement=separate", "trainer.n_workers=2", "rollout.n_workers=1"]))
    assert facts.split_critic and facts.separate_rollout
    assert facts.groups == {"actor": 2, "critic": 2, "rollout": 1} and facts.rollout_ranks == 1


def test_partial_rollouts_keep_extra_prompt_batches_in_flight_and_train_off_policy():
    facts = resolve_facts(load_config(["data.train_batch_size=4", "rollout.n=3", "rollout.partial=true",
                                       "rollout.partial_extra_batches=2", "trainer.n_workers=2"]))
    assert facts.step_rows == 12 and facts.rows_in_flight == 36 and facts.rollout_ranks == 2 and facts.off_policy


def test_router_hooks_follow_the_moe_keys_and_reach_the_actor_config():
    from hybridflow.engine.train.router_replay import RouterHooks
    from hybridflow.trainer.role_configs import actor_config

    plain = load_config([])
    assert not resolve_facts(plain).router_hooks and actor_config(plain, 1).router is None
    replay = ["rollout.record_routes=true", "actor.router_replay=rollout"]
    for keys, router in ((["rollout.record_routes=true"], RouterHooks.Config()),
                         (replay, RouterHooks.Config(replay=True)),
                         (["actor.router_aux_loss_coef=0.01"], RouterHooks.Config(aux_loss_coef=0.01))):
        cfg = load_config(keys)
        assert resolve_facts(cfg).router_hooks and actor_config(cfg, 1).router == router
