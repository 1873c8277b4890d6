"""validate: batch-size relations with the valid values named, estimator needs, ranges, paths."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.validate import divisors


def _cfg(*overrides):
    return load_config(["rollout.n=4", "data.train_batch_size=8", *overrides])


def _problems(cfg, n_workers=None) -> str:
    with pytest.raises(ConfigError) as e:
        validate(cfg, n_workers=n_workers, check_paths=False)
    return str(e.value)


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(0) == []


def test_valid_config_passes():
    validate(_cfg("actor.mini_batch_size=4", "actor.micro_batch_size=2"), n_workers=2, check_paths=False)
    validate(_cfg(), n_workers=4, check_paths=False)  # null mini-batch = whole batch: 32 rows / 4


def test_mini_batch_must_divide_batch():
    msg = _problems(_cfg("actor.mini_batch_size=3"))
    assert "actor.mini_batch_size=3 must divide data.train_batch_size=8; valid: 1, 2, 4, 8" in msg


def test_mini_batch_rows_divisible_by_workers():
    msg = _problems(_cfg("rollout.n=3", "actor.mini_batch_size=1"), n_workers=2)
    assert "actor mini-batch rows (actor.mini_batch_size=1 x rollout.n=3 = 3) must divide by " \
           "trainer.n_workers=2; valid actor.mini_batch_size: 2, 4, 8" in msg
    msg = _problems(_cfg("rollout.n=3", "data.train_batch_size=1"), n_workers=2)
    assert "no mini_batch_size works; valid trainer.n_workers: 1, 3" in msg
    # n_workers comes from the config when not passed
    assert "trainer.n_workers=2" in _problems(_cfg("rollout.n=3", "actor.mini_batch_size=1", "trainer.n_workers=2"))


def test_micro_batch_divides_per_rank_rows():
    # 4 prompts x 4 samples / 2 ranks = 8 rows per rank
    msg = _problems(_cfg("actor.mini_batch_size=4", "actor.micro_batch_size=3"), n_workers=2)
    assert "actor.micro_batch_size=3 must divide the per-rank mini-batch of 8 rows" in msg
    assert "valid: 1, 2, 4, 8" in msg
    # a token budget replaces micro_batch_size, but must hold one whole sequence
    validate(_cfg("actor.micro_batch_size=3", "actor.max_tokens_per_micro_batch=4096"), check_paths=False)
    assert "use >= 1024" in _problems(_cfg("actor.max_tokens_per_micro_batch=100"))


def test_critic_checked_only_with_gae():
    validate(_cfg("critic.mini_batch_size=3"), check_paths=False)
    assert "critic.mini_batch_size=3 must divide" in _problems(_cfg("critic.mini_batch_size=3",
                                                                     "algorithm.adv_estimator=gae"))


def test_estimator_needs():
    assert "rollout.n=1 must be >= 2" in _problems(_cfg("rollout.n=1", "algorithm.adv_estimator=rloo"))
    assert "rollout.temperature=0.0 must be > 0" in _problems(
        _cfg("algorithm.adv_estimator=remax", "rollout.temperature=0"))
    assert "every advantage is 0; use rollout.temperature > 0" in _problems(_cfg("rollout.temperature=0"))
    assert "rollout.val_n=4 with rollout.val_temperature=0" in _problems(_cfg("rollout.val_n=4"))
    assert "set algorithm.use_kl_in_reward=true" in _problems(_cfg("algorithm.kl_ctrl.type=adaptive",
                                                                   "algorithm.use_kl_in_reward=false"))
    assert "overlong_buffer.len=600 must be in [1, data.max_response_length=512)" in _problems(
        _cfg("algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=600"))
    assert "critic.warmup_steps=2 needs a critic" in _problems(_cfg("critic.warmup_steps=2"))


def test_ranges_and_all_problems_listed_together():
    msg = _problems(_cfg("rollout.top_p=0", "actor.lr=0", "trainer.val_every=-1"))
    assert msg.startswith("3 problems in the configuration:")
    assert "rollout.top_p=0.0 must be in (0.0, 1.0]" in msg
    assert "actor.lr=0.0 must be in (0.0, inf)" in msg
    assert "trainer.val_every=-1 must be >= 0" in msg


def test_paths(tmp_path):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    model = tmp_path / "model"
    model.mkdir()
    good = _cfg(f"model.path={model}", f"data.train_files={data}")
    validate(good)
    with pytest.raises(ConfigError) as e:
        validate(_cfg(f"data.val_files={tmp_path}/nope.parquet", f"reward.function={tmp_path}/r.py:fn",
                      "trainer.resume=/no/such/ckpt", f"model.path={tmp_path}/missing"))
    msg = str(e.value)
    assert "data.train_files is required" in msg and "nope.parquet not found" in msg
    assert "r.py:fn'" in msg and "does not exist" in msg and "trainer.resume='/no/such/ckpt'" in msg
    assert f"model.path={tmp_path}/missing: no such directory" in msg
    with pytest.raises(ConfigError, match="model.path is required"):
        validate(_cfg(f"data.train_files={data}"))
    with pytest.raises(ConfigError, match=rf"data.train_files: {tmp_path} is a directory; give a .parquet or "
                                          rf".jsonl file in it \(or a list of them\)"):
        validate(_cfg(f"model.path={model}", f"data.train_files={tmp_path}"))


def test_sft_config_gets_the_shared_checks_and_its_own(tmp_path):
    from hybridflow.config.sft_schema import SFTConfig
    from hybridflow.config.validate import validate_sft

    data = tmp_path / "chats.jsonl"
    data.write_bytes(b"")
    base = [f"model.path={tmp_path}", f"data.train_files={data}", "data.train_batch_size=4"]
    validate_sft(load_config(base, schema=SFTConfig))
    with pytest.raises(ConfigError) as e:
        validate_sft(load_config([*base, f"model.tokenizer_path={tmp_path}/tok", "trainer.resume=/no/such/ckpt",
                                  "trainer.n_workers=8", "optim.mini_batch_size=3", "optim.lr=0",
                                  "trainer.total_steps=0", f"data.val_files={tmp_path}/val.jsonl"], schema=SFTConfig))
    msg = str(e.value)
    assert msg.startswith("7 problems in the configuration:")
    assert f"model.tokenizer_path={tmp_path}/tok: no such directory" in msg and "val.jsonl not found" in msg
    assert "trainer.resume='/no/such/ckpt': no such checkpoint" in msg and "optim.lr=0.0 must be in (0.0, inf)" in msg
    assert "data.train_batch_size=4 gives some of trainer.n_workers=8 ranks no conversation" in msg
    assert "optim.mini_batch_size=3 must divide data.train_batch_size=4; valid: 1, 2, 4 or null" in msg
    assert "trainer.total_steps=0 must be >= 1" in msg


def test_reward_function_resolved_before_training(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    base = ["model.path=some-org/some-model", f"data.train_files={data}"]
    with pytest.raises(ConfigError, match=r"unknown reward function 'gsm8kk' \(did you mean 'gsm8k'\?\)"):
        validate(_cfg(*base, "reward.function=gsm8kk"))
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    validate(_cfg(*base, f"reward.function={reward}:score"))
    with pytest.raises(ConfigError, match="has no function 'scor'; did you mean 'score'"):
        validate(_cfg(*base, f"reward.function={reward}:scor"))
    exiting = tmp_path / "exiting_reward.py"  # a file that ends the process when imported is a problem, named
    exiting.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ConfigError, match=r"reward.function='.*exiting_reward.py:score': importing it raised "
                                          r"SystemExit\(3\)"):
        validate(_cfg(*base, f"reward.function={exiting}:score"))


def test_agent_section_checked_before_training(tmp_path):
    msg = _problems(_cfg("agent.max_turns=0", "agent.max_tool_calls=-1", "agent.max_tokens_per_turn=0",
                         "agent.timeout_s=0", "agent.tools=[calculator]", "rollout.engine=hf"))
    for part in ("agent.max_turns=0 must be >= 1", "agent.max_tool_calls=-1 must be >= 0",
                 "agent.max_tokens_per_turn=0 must be >= 1 or null", "agent.timeout_s=0.0 must be > 0",
                 "agent.tools: multi-turn episodes continue live sequences turn by turn, which the fast engine does "
                 "and rollout.engine=hf (transformers.generate) does not; use rollout.engine=auto or fast"):
        assert part in msg
    assert "agent.runner: multi-turn episodes continue live sequences" in _problems(
        _cfg("agent.runner=agent.py:play", "reward.function=environment", "rollout.engine=hf"))
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    env = tmp_path / "env.py"
    env.write_text("class Env:\n    def step(self, text, turn):\n        return None\n")
    base = ["model.path=some-org/some-model", f"data.train_files={data}"]
    validate(_cfg(*base, f"agent.environment={env}:Env", "agent.tools=[calculator, python]"))
    with pytest.raises(ConfigError, match=r"agent.environment='.*env.py:Envv'.*no class 'Envv'; did you mean 'Env'"):
        validate(_cfg(*base, f"agent.environment={env}:Envv"))
    with pytest.raises(ConfigError, match=r"agent.tools: agent.tools\[1\]: 'pyhton' is neither a built-in tool"):
        validate(_cfg(*base, "agent.tools=[calculator, pyhton]"))


def test_the_endpoint_ways_in_are_checked_before_training(tmp_path):
    msg = _problems(_cfg("agent.runner=agent.py:play", "agent.gym=Maze", "agent.tools=[calculator]",
                         "agent.max_concurrent_requests=0", "agent.runner_processes=0"))
    for part in ("agent.runner, agent.gym drive the model through the endpoint and exclude each other and "
                 "agent.environment / agent.tools: set one of them",
                 "agent.gym='Maze' must name what to load: path/to/file.py:Name or package.module:Name (or "
                 "textarena:<env id>)", "agent.max_concurrent_requests=0 must be >= 1",
                 "agent.runner_processes=0 must be >= 1 (or null: min(16, CPU cores))"):
        assert part in msg
    python_built = _cfg("agent.runner=agent.py:play")
    python_built.reward.function = "auto"  # as in a config built in Python, where nothing follows
    assert "agent.runner returns each trajectory's reward: set reward.function=environment" in _problems(python_built)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    base = ["model.path=some-org/some-model", f"data.train_files={data}", "reward.function=environment"]
    validate(_cfg(*base, "agent.gym=textarena:GuessTheNumber-v0"))
    with pytest.raises(ConfigError, match=r"agent.runner='.*missing.py:play': the file '.*missing.py' does not exist"):
        validate(_cfg(*base, f"agent.runner={tmp_path}/missing.py:play"))


def test_registered_estimators_are_valid_choices():
    from hybridflow.algorithms import ADV_ESTIMATORS, register_adv_estimator

    with pytest.raises(ConfigError, match="valid: gae, grpo, rloo"):
        load_config(["algorithm.adv_estimator=my_estimator"])
    register_adv_estimator("my_estimator")(lambda data: (None, None))
    try:
        assert load_config(["algorithm.adv_estimator=my_estimator"]).algorithm.adv_estimator == "my_estimator"
    finally:
        ADV_ESTIMATORS.unregister("my_estimator")


def test_ray_keys_need_the_ray_backend_and_a_group_to_place():
    assert ("ray.address=auto, ray.actor.nnodes=2 place worker groups on a Ray cluster, but trainer.backend=local "
            "runs them on this machine; set trainer.backend=ray (unset, it follows)") in _problems(
        _cfg("ray.address=auto", "ray.actor.nnodes=2", "trainer.backend=local"))
    ray = ("trainer.backend=ray", "trainer.n_workers=4")
    validate(_cfg(*ray, "ray.actor.nnodes=2", "ray.actor.strategy=pack", "ray.actor.node_resource=gpu_a"),
             check_paths=False)
    assert ("ray.actor.nnodes=3 must divide the actor group's 4 processes (trainer.n_workers) into equal shares "
            "per node; valid: 1, 2, 4") in _problems(_cfg(*ray, "ray.actor.nnodes=3"))
    assert ("ray.rollout.nnodes=2 place the separate rollout group, which this run does not start; set "
            "rollout.placement=separate (unset, it follows) or leave ray.rollout at its defaults") in _problems(
        _cfg(*ray, "ray.rollout.nnodes=2", "rollout.placement=colocate"))
    assert "ray.rollout.nnodes=3 must divide the rollout group's 2 processes (rollout.n_workers)" in _problems(
        _cfg(*ray, "rollout.placement=separate", "rollout.n_workers=2", "ray.rollout.nnodes=3"))
    assert "ray.address=ray://head:10001 is a Ray Client address" in _problems(
        _cfg(*ray, "ray.address=ray://head:10001"))


def test_rollout_correction_mode_and_bounds():
    with pytest.raises(ConfigError, match="valid: none, token_tis, seq_tis, token_mis, seq_mis"):
        load_config(["actor.rollout_correction.mode=token_ts"])
    assert "actor.rollout_correction.threshold=0.0 must be > 0" in _problems(
        _cfg("actor.rollout_correction.mode=token_tis", "actor.rollout_correction.threshold=0"))
    msg = _problems(_cfg("actor.rollout_correction.mode=token_mis", "actor.rollout_correction.threshold_lower=3"))
    assert "actor.rollout_correction.threshold_lower=3.0 must be in (0, actor.rollout_correction.threshold=2.0)" in msg


def test_gspo_refuses_ppo_sized_clip_bounds_and_names_the_papers():
    msg = _problems(_cfg("actor.policy_loss=gspo"))
    assert ("actor.policy_loss=gspo clips a sequence-level ratio (the geometric mean of the token ratios, far closer "
            "to 1 than one token's): actor.clip_low=0.2 / actor.clip_high=0.2 are PPO-sized (>= 0.01) and would "
            "almost never clip; use the GSPO paper's actor.clip_low=3e-4 actor.clip_high=4e-4 "
            "(recipes/gspo.yaml)") in msg
    assert "actor.clip_high=0.01 are PPO-sized" in _problems(_cfg("actor.policy_loss=gspo", "actor.clip_low=3e-4",
                                                                  "actor.clip_high=0.01"))
    validate(_cfg("actor.policy_loss=gspo", "actor.clip_low=3e-4", "actor.clip_high=4e-4"), check_paths=False)
    validate(_cfg("actor.policy_loss=ppo", "actor.clip_low=3e-4"), check_paths=False)


def test_reward_workers_may_be_zero_but_not_negative():
    validate(_cfg("reward.num_workers=0"), check_paths=False)
    assert "reward.num_workers=-1 must be >= 0" in _problems(_cfg("reward.num_workers=-1"))


def test_lora_ranges_are_checked_in_every_trained_section(tmp_path):
    from hybridflow.config.sft_schema import SFTConfig
    from hybridflow.config.validate import validate_sft

    msg = _problems(_cfg("actor.lora.rank=-1", "actor.lora.alpha=0", "critic.lora.dropout=1.0"))
    assert "actor.lora.rank=-1 must be >= 0 (0 = no LoRA)" in msg and "actor.lora.alpha=0.0 must be > 0" in msg
    assert "critic.lora.dropout=1.0 must be in [0.0, 1.0)" in msg
    msg = _problems(_cfg("actor.lora.rank=8", "actor.ref_param_offload=true"))
    assert "which a LoRA actor (actor.lora.rank=8) does not have" in msg
    with pytest.raises(ConfigError, match="optim.lora.dropout=-0.1 must be in"):
        validate_sft(load_config([f"model.path={tmp_path}", "optim.lora.dropout=-0.1"], schema=SFTConfig))
    with pytest.raises(ConfigError, match="actor.lora.init"):
        load_config(["actor.lora.init=pissa"])
