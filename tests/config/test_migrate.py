"""`hybridflow migrate` (issue 36, item 4): a verl command line and a verl YAML config, written here in verl's
public shapes, become recipes that load, with every key commented with its verl origin and every key not
carried listed with why."""

from __future__ import annotations

import textwrap

from hybridflow import cli
from hybridflow.config import load_config

SCRIPT = """
    set -x
    gsm8k_train=$DATA_ROOT/gsm8k/train.parquet
    export VLLM_ATTENTION_BACKEND=XFORMERS

    python3 -m verl.trainer.main_ppo \\
        algorithm.adv_estimator=grpo \\
        data.train_files="['$gsm8k_train']" \\
        data.val_files=$gsm8k_test \\
        data.train_batch_size=64 \\
        data.filter_overlong_prompts=True \\
        actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \\
        actor_rollout_ref.actor.optim.lr=1e-6 \\
        actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
        actor_rollout_ref.actor.use_kl_loss=True \\
        actor_rollout_ref.actor.kl_loss_coef=0.002 \\
        actor_rollout_ref.actor.clip_ratio=0.28 \\
        actor_rollout_ref.rollout.name=vllm \\
        actor_rollout_ref.rollout.n=8 \\
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 \\
        +custom_reward_function.reward_kwargs.method=flexible \\
        custom_reward_function.path=rewards/gsm8k.py \\
        trainer.logger='["console","swanlab"]' \\
        trainer.n_gpus_per_node=8 trainer.nnodes=2 \\
        trainer.save_freq=-1 trainer.test_freq=5 $@
"""

CONFIG = """
    defaults:
      - ppo_trainer
      - _self_
    data:
      train_batch_size: 32
      max_response_length: 1024
    actor_rollout_ref:
      model:
        path: /models/qwen
        lora_rank: 32
        lora_alpha: 64
        target_modules: all-linear
      actor:
        use_torch_compile: false
        ppo_mini_batch_size: 8
        use_dynamic_bsz: true
        ppo_max_token_len_per_gpu: 8192
        policy_loss:
          loss_mode: gspo
      rollout:
        enforce_eager: true
        val_kwargs:
          do_sample: false
        multi_turn:
          enable: true
          tool_config_path: tools/gsm8k_tool_config.yaml
          max_assistant_turns: 5
          max_user_turns: 5
    algorithm:
      adv_estimator: grpo_passk
      rollout_correction:
        rollout_is: sequence
        rollout_is_threshold: 3.0
    reward_model:
      reward_manager: dapo
    trainer:
      resume_mode: disable
      critic_warmup: 0
      default_local_dir: ${trainer.project_name}/ckpt
"""


def test_a_verl_command_line_becomes_a_recipe(tmp_path, monkeypatch, capsys):
    script = tmp_path / "run_grpo.sh"
    script.write_text(textwrap.dedent(SCRIPT))
    monkeypatch.setenv("DATA_ROOT", "/data")
    monkeypatch.delenv("gsm8k_test", raising=False)
    recipe = tmp_path / "recipe.yaml"
    assert cli.main(["migrate", str(script), "--out", str(recipe)]) == 0
    cfg = load_config([], recipe)
    assert cfg.data.train_files == ["/data/gsm8k/train.parquet"] and cfg.data.truncation == "filter"
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.actor.lr == 1e-6 and cfg.actor.mini_batch_size == 16
    assert cfg.actor.kl_loss_coef == 0.002 and cfg.actor.clip_low == cfg.actor.clip_high == 0.28
    assert cfg.rollout.engine == "auto" and cfg.rollout.n == 8
    assert cfg.reward.function == "rewards/gsm8k.py:compute_score" and cfg.reward.kwargs == {"method": "flexible"}
    assert cfg.trainer.loggers == ["console"] and cfg.trainer.save_every == 0 and cfg.trainer.val_every == 5
    assert cfg.trainer.n_workers == 16 and cfg.trainer.backend == "ray" and cfg.ray.actor.nnodes == 2
    assert cfg.actor.shuffle is False and cfg.trainer.total_epochs == 30  # verl's defaults, not ours
    text = recipe.read_text()
    assert "  lr: 1.0e-06  # actor_rollout_ref.actor.optim.lr\n" in text
    assert "  total_epochs: 30  # verl's default trainer.total_epochs=30\n" in text
    assert "#   actor_rollout_ref.rollout.tensor_model_parallel_size=2: each device runs a data-parallel rollout " \
           "replica\n" in text
    assert "#   data.val_files=$gsm8k_test: holds a shell variable neither the script nor the environment sets" in text
    assert "swanlab" not in str(cfg.trainer.loggers)


def test_a_verl_yaml_config_becomes_a_recipe_and_values_ours_lack_are_listed(tmp_path, capsys):
    config = tmp_path / "verl.yaml"
    config.write_text(textwrap.dedent(CONFIG))
    assert cli.main(["migrate", str(config)]) == 0
    text = capsys.readouterr().out
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    cfg = load_config([], recipe)
    assert cfg.actor.lora.rank == 32 and cfg.actor.lora.alpha == 64 and cfg.actor.lora.target_modules == ["all-linear"]
    assert cfg.model.compile is False and cfg.actor.max_tokens_per_micro_batch == 8192
    assert cfg.actor.policy_loss == "gspo" and cfg.rollout.cuda_graphs is False and cfg.rollout.val_temperature == 0
    assert cfg.agent.tools == ["tools/gsm8k_tool_config.yaml"] and cfg.agent.max_turns == 5
    assert cfg.actor.rollout_correction.mode == "seq_tis" and cfg.actor.rollout_correction.threshold == 3.0
    assert cfg.trainer.resume == "never" and cfg.algorithm.adv_estimator == "grpo"  # grpo_passk is not carried
    for line in ("# Read: defaults: ppo_trainer: verl's own config; its defaults that differ from hybridflow's are set",
                 "#   actor_rollout_ref.rollout.multi_turn.max_user_turns=5: episodes are bounded by agent.max_turns",
                 "#   reward_model.reward_manager=dapo: one manager: a process pool with a per-row timeout",
                 "#   trainer.default_local_dir=${trainer.project_name}/ckpt: an interpolation of verl's config",
                 "#   algorithm.adv_estimator=grpo_passk: algorithm.adv_estimator: invalid value 'grpo_passk'"):
        assert line in text, line


def test_verl_engine_sft_trainer_reads_conversations_with_its_own_defaults(tmp_path):
    """verl's engine SFT trainer (`verl.trainer.sft_trainer`) reads `messages` and has defaults of its own (lr 1e-3,
    a constant schedule), unlike its FSDP SFT trainer (`question` / `answer`, cosine): each script gets its
    trainer's."""
    from hybridflow.config.sft_schema import SFTConfig

    recipes = {}
    for trainer in ("sft_trainer", "fsdp_sft_trainer"):
        script = tmp_path / f"{trainer}.sh"
        script.write_text(f"torchrun --nproc_per_node=1 -m verl.trainer.{trainer} data.train_files=/d/t.parquet "
                          f"model.path=Qwen/Qwen2.5-0.5B-Instruct\n")
        recipes[trainer] = tmp_path / f"{trainer}.yaml"
        assert cli.main(["migrate", str(script), "--out", str(recipes[trainer])]) == 0
    engine = load_config([], recipes["sft_trainer"], schema=SFTConfig)
    assert engine.data.messages_key == "messages" and engine.optim.lr == 1e-3 and engine.optim.lr_schedule == "constant"
    assert "messages_key: messages  # verl's default data.messages_key=messages" in recipes["sft_trainer"].read_text()
    assert "prompt_key" not in recipes["sft_trainer"].read_text()
    fsdp = load_config([], recipes["fsdp_sft_trainer"], schema=SFTConfig)
    assert fsdp.data.prompt_key == "question" and fsdp.data.response_key == "answer"
    assert fsdp.optim.lr_schedule == "cosine"
