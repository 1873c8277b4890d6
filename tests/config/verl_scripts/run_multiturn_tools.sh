# A multi-turn GRPO run with a tool, an interaction and a custom reward, in verl's shape.
# Run from the project root.
set -x
ulimit -n 65535

PROJECT_DIR="$(pwd)"
HERE=$(cd -- "$(dirname "${BASH_SOURCE[0]}")" >/dev/null 2>&1 && pwd)
CONFIG_PATH="$PROJECT_DIR/verl_scripts/config"
export WANDB_API_KEY=not-a-real-key-0123
export VLLM_USE_V1=1
JUDGE_TOKEN=tok-0123

function now() {
    date '+%d-%H-%M'
}

TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-4}
OFFLOAD=${OFFLOAD:-False}
EXPERIMENT_NAME="multiturn_$(now)"

python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name='multiturn_grpo' \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=$TRAIN_BATCH_SIZE \
    data.max_response_length=$((32 * 2)) \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.return_raw_chat=True \
    data.train_files=$HOME/data/multiturn/train.parquet \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=$TRAIN_BATCH_SIZE \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.ref.fsdp_config.param_offload=$OFFLOAD \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.n=2 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/config/tool_config.yaml" \
    actor_rollout_ref.rollout.multi_turn.interaction_config_path="$PROJECT_DIR/verl_scripts/config/interaction_config.yaml" \
    custom_reward_function.path="$HERE/reward.py" \
    custom_reward_function.name=score_answer \
    +custom_reward_function.reward_kwargs.api_token=$JUDGE_TOKEN \
    global_profiler.tool=torch_memory \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='multiturn' \
    trainer.experiment_name=$EXPERIMENT_NAME \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 $@
