# GRPO with LoRA, arrays of arguments as some verl examples write them; run from the project root.
set -xeuo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
n_resp=2
batch=4

common=(
    algorithm.adv_estimator=grpo
    "data.train_files=['$HOME/data/gsm8k/train.parquet']"
    data.train_batch_size=${batch}
    data.max_prompt_length=128
    data.max_response_length=16
)
actor=(
    actor_rollout_ref.model.path="${MODEL}"
    actor_rollout_ref.model.lora_rank=8
    actor_rollout_ref.model.lora_alpha=16
    actor_rollout_ref.model.target_modules=all-linear
    actor_rollout_ref.actor.ppo_mini_batch_size=$((batch / 2))
    actor_rollout_ref.actor.optim.lr=3e-6
    actor_rollout_ref.ref.fsdp_config.param_offload=True
)
rollout=(actor_rollout_ref.rollout.n=${n_resp} actor_rollout_ref.rollout.name=vllm)
if [ "$MODEL" = "Qwen/Qwen2.5-0.5B-Instruct" ]; then
    rollout+=(actor_rollout_ref.rollout.gpu_memory_utilization=0.4)
else
    rollout+=(actor_rollout_ref.rollout.gpu_memory_utilization=0.8)
fi

python3 -m verl.trainer.main_ppo \
    "${common[@]}" \
    "${actor[@]}" \
    "${rollout[@]}" \
    trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_epochs=1 \
    trainer.logger=console trainer.val_before_train=False 2>&1 | tee lora.log
