# verl's SFT trainer under torchrun, with the world size from the arguments as verl's SFT examples take it,
# reading the question and answer from the gsm8k parquet's extra_info dict as verl's gsm8k SFT examples do.
set -x

if [ "$#" -lt 2 ]; then
    echo "Usage: run_sft.sh <nproc_per_node> <save_path>"
    exit 1
fi
nproc_per_node=${1:-1}
save_path=$2

torchrun --standalone --nnodes=1 --nproc_per_node=$nproc_per_node \
    -m verl.trainer.fsdp_sft_trainer \
    data.train_files=$HOME/data/sft/train.parquet \
    data.prompt_key=extra_info \
    data.response_key=extra_info \
    +data.prompt_dict_keys=['question'] \
    +data.response_dict_keys=['answer'] \
    data.micro_batch_size_per_gpu=2 \
    data.train_batch_size=4 \
    optim.lr=1e-4 \
    model.partial_pretrain=Qwen/Qwen2.5-0.5B-Instruct \
    trainer.default_local_dir=$save_path \
    trainer.project_name=sft trainer.logger=console \
    trainer.total_epochs=1 $@ \
    use_remove_padding=true
