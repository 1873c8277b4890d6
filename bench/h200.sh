#!/usr/bin/env bash
# The H200 runs behind docs/benchmarks.md, as stages that each fit one device call (10 minutes at most):
#
#   HYBRIDFLOW_COMMIT=<sha> bash bench/h200.sh gpu_tests train grpo     # one call
#   bash bench/h200.sh model_part1                                       # two calls back to back: the GGUF
#   bash bench/h200.sh model_part2 race                                  #   travels as two pieces
#   (multiturn, multiturn_train and distill also need the GGUF)
#
# The device machine has torch, transformers, peft and pandas but not our other dependencies: they travel
# as wheels in .whl/ (omegaconf, trl, datasets, dill, multiprocess, gguf, torchao, fla, aiohttp), installed into
# /tmp/site by every stage run; `bash bench/wheels.sh` builds .whl/, .whl2/ and the GGUF's pieces from .venv/'s
# versions. The real model's GGUF (98 MB) travels as .gguf1/part and .gguf2/part (49 MB
# each: a call carries 64 MiB with the tracked tree, so with the agents' wheels in .whl/ the first call carries
# .whl alone, then one call per piece, back to back: the machine is given back after 30 s idle).
# Results (JSON, PNG, logs) go to $OUT when set (the device tool's output folder), else bench/results; the
# device tool brings back at most 8 files a call, so a call should run stages that write no more.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
GGUF=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

setup() {
    [ -d /tmp/site/omegaconf ] && return
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}

# the SmolLM2 tests need the GGUF (model_part1 / model_part2 first); without it they are left to exact_tests.
# GPU_TESTS: the paths to run (default tests); GPU_K: a -k expression (a variable of its own: GPU_TESTS is split at
# spaces, so a quoted expression inside it would not survive)
gpu_tests() {
    local real=(-k "not smollm2")
    [ -f "$GGUF" ] && real=()
    [ -n "${GPU_K:-}" ] && real=(-k "$GPU_K")
    SMOLLM2_GGUF="$GGUF" python3 -m pytest -q -m gpu "${real[@]}" ${GPU_TESTS:-tests} -p no:cacheprovider --durations=20 2>&1 \
        | tee "$OUT/gpu_tests.log"
}
# compiled layers only (eager was measured at 1ba0230); the device plan's defaults are 16k plain micro-batches
# at 1.5B and 32k checkpointed ones at 0.5B
train() { python3 bench/train.py --compile on --budgets full,16384,32768 --checkpointing off,on \
    --out "$OUT/train_h200.json" 2>&1 | tee "$OUT/train.log"; }
# the learning race's update (SmolLM2-135M's shape, 512 rows): eager against compiled, micro-batch budgets up to
# one forward, with recomputation (issue 23)
train_race() { python3 bench/train.py --shapes smollm2 --budgets 32768,65536,full --compile off,on --checkpointing on \
    --profile --out "$OUT/train_race_h200.json" 2>&1 | tee "$OUT/train_race.log"; }
# 8 steps: TRL's steps vary by a third from one to the next, and its median needs several
grpo() { python3 bench/grpo_vs_trl.py --device cuda --steps 8 --out "$OUT/grpo_vs_trl_cuda.json" 2>&1 | tee "$OUT/grpo.log"; }
# a DPO step against TRL's DPOTrainer at the 0.5B shape, real vocabulary, 32 pairs of 256 + 256 tokens; TRL with
# its reference precomputed (our work per step) and with its default per-step reference model (issue 41)
dpo() { python3 bench/dpo_vs_trl.py --device cuda --trl-ref precompute,per-step --out "$OUT/dpo_vs_trl_h200.json" \
    2>&1 | tee "$OUT/dpo.log"; }
# ours in pure bf16 (model.master_dtype=bf16, which needs the 8-bit AdamW's stochastic rounding), the precision the
# benchmark's TRL trains in (its model loads in bf16: bf16 weights, gradients and AdamW state)
dpo_bf16() { python3 bench/dpo_vs_trl.py --device cuda --trl-ref precompute --set model.master_dtype=bf16 \
    --set optim.optimizer=adamw_8bit --out "$OUT/dpo_vs_trl_bf16_h200.json" 2>&1 | tee "$OUT/dpo_bf16.log"; }
rollout() { python3 bench/rollout.py --device cuda --skip-long --profile --out "$OUT/rollout_h200.json" 2>&1 \
    | tee "$OUT/rollout.log"; }
# the other families' fast paths at their real shapes (issue 59, docs/models.md): OLMo 2 1B, Phi-3-mini, Phi-4-mini
# (partial rotary), Gemma 3 4B (text), Qwen3.5-0.8B (hybrid linear attention) and Qwen3-Next-80B-A3B's first 4 layers
# (hybrid, 512 experts) against generate at batch 256;
# FAMILY_SHAPES picks fewer where one call cannot hold them all. Qwen3.5's kernels on both sides (ours and
# transformers') are flash-linear-attention's: its wheels go into .whl/ with the others
# (pip download --no-deps -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2)
# (`generate` timed over 64 new tokens, FAMILY_HF_TOKENS: at 256 the 512-expert Qwen3-Next shape's did not end in 240 s)
families() { python3 bench/rollout.py --device cuda --hf-new-tokens "${FAMILY_HF_TOKENS:-64}" \
    --shapes ${FAMILY_SHAPES:-olmo2-1b phi3-mini phi4-mini gemma3-4b qwen3.5-0.8b qwen3-next-80b-a3b-4l} \
    --out "$OUT/rollout_families_h200.json" 2>&1 | tee "$OUT/rollout_families.log"; }
# where the prefill's time goes at one shape (issue 59): 256 prompts x 128 tokens, one new token each, the first run
# timed apart (one H100: 49.2 s of kernel compilation at Qwen3.5-0.8B, then 0.243 s), a torch.profiler table;
# PREFILL_SHAPE picks another shape
prefill_profile() { python3 bench/prefill_profile.py --device cuda --shape "${PREFILL_SHAPE:-qwen3.5-0.8b}" \
    --out "$OUT/prefill_profile_h200.json" 2>&1 | tee "$OUT/prefill_profile.log"; }
# vision-language rollout (issue 59; docs/models.md#vision-language-models): VisionRolloutEngine against generate at
# the Qwen2.5-VL-3B shape, one 448 x 448 image per prompt, 32 prompts x 8, 256 new tokens (target >= 10x)
vision_rollout() { python3 bench/vision_rollout.py --device cuda --out "$OUT/vision_rollout_h200.json" 2>&1 \
    | tee "$OUT/vision_rollout.log"; }
# a GRPO step of Qwen2.5-VL at its 3B shape (issue 59): random weights, one 448 x 448 image per prompt, 16 prompts x 8,
# recipes/geo3k_vl.yaml with the device plan's defaults; step time, phases and the device peak
# (a run cut short by the call's limit leaves its 7 GB model in /tmp/vision_step_*, and the trainer refuses to start
# without the ~42 GiB a 3B checkpoint needs free: those are removed first)
vision_step() {
    rm -rf /tmp/vision_step_*
    python3 bench/vision_step.py --device cuda --steps "${VISION_STEPS:-3}" --out "$OUT/vision_step_h200.json" 2>&1 \
        | tee "$OUT/vision_step.log"
}
# the decode attention kernel alone: tiles, warps and splits at the engine's shapes, and over SmolLM2's long slots with
# spread contexts (issue 42: at 8,192 tokens a partial rollout's full buffer generated at a third of the rate of a
# synchronous step's fewer rows)
decode_attention() { python3 bench/rollout.py --device cuda --attention-only --out "$OUT/decode_attention_h200.json" \
    2>&1 | tee "$OUT/decode_attention.log"; }
# the decode step's GEMMs alone: cuBLAS, cuBLASLt and Triton tiles at 64-512 rows (issue 19)
decode_gemm() { python3 bench/decode_gemm.py --device cuda --out "$OUT/decode_gemm_h200.json" 2>&1 | tee "$OUT/decode_gemm.log"; }
# FP8 rollout (issue 54; docs/rollout.md#fp8-rollout): rollout.quantization=fp8 against bf16 at batch 256, the 1.5B and
# 7B shapes (targets 1.5x and 1.6x tok/s), weight sync, peak memory, each projection's GEMM alone (~3 minutes);
# FP8_PROFILE=1 adds where the FP8 decode step's time goes. fp8_tests: its GPU tests
fp8_rollout() { python3 bench/fp8_rollout.py --device cuda ${FP8_PROFILE:+--profile} --out "$OUT/fp8_rollout_h200.json" \
    2>&1 | tee "$OUT/fp8_rollout.log"; }
fp8_tests() { python3 -m pytest -q -m gpu tests/engine/rollout/test_rollout_fp8_gpu.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/fp8_tests.log"; }
# our side of the learning race with the FP8 rollout and the correction the docs recommend (token_tis), then the
# default bf16 run's (no correction), RACE_BUDGET_S (default 150) each (needs the GGUF: model_part1, model_part2): the
# mismatch of every step and both accuracy-against-time curves
fp8_race() {
    local mode
    for mode in fp8 none; do
        python3 bench/learn_vs_trl.py --device cuda --model "$GGUF" --only hybridflow \
            --budget-s "${RACE_BUDGET_S:-150}" --eval-every-s "${RACE_EVERY_S:-15}" \
            --set rollout.quantization=$mode \
            --set actor.rollout_correction.mode=$([ $mode = fp8 ] && echo token_tis || echo none) \
            --out "$OUT/race_fp8_$mode.json" 2>&1 | tail -6 | tee -a "$OUT/fp8_race.log"
        rm -f "$OUT/race_fp8_$mode.png"
    done
}
rollout_long() { python3 bench/rollout.py --device cuda --long --long-max "${LONG_MAX:-4096}" \
    --out "$OUT/rollout_long_h200.json" 2>&1 | tee "$OUT/rollout_long.log"; }
scale() { python3 bench/scale.py --configs "${SCALE_CONFIGS:-1.5b:default,3b:default,7b:8bit,14b:bf16_8bit}" \
    --budget-s "${SCALE_BUDGET_S:-540}" --out "$OUT/scale_h200.json" 2>&1 | tee "$OUT/scale.log"; }
# small cards (issue 54; docs/small_gpus.md): GRPO 16 x 8, <= 512 new tokens, 3 steps, each setting under
# trainer.device_memory_gib beside the uncapped steps it is compared with; one call per shape
small_gpu_15b() { python3 bench/small_gpu.py --device cuda --settings 1.5b --budget-s 100 \
    --out "$OUT/small_gpu_1.5b.json" 2>&1 | tee "$OUT/small_gpu_1.5b.log"; }
small_gpu_7b() { python3 bench/small_gpu.py --device cuda --settings 7b --budget-s 170 \
    --out "$OUT/small_gpu_7b.json" 2>&1 | tee "$OUT/small_gpu_7b.log"; }
# where the first compiled step's stall goes (issue 23): the race's model shape, random weights, cold caches
compile_first_step() {
    local cache
    cache=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR=$cache TRITON_CACHE_DIR=$cache/triton python3 bench/compile_first_step.py --device cuda \
        --model smollm2 --mode cold --checkpointing --rows 64 --prompt 100 --response 200 \
        --out "$OUT/compile_first_step.json" 2>&1 \
        | tee "$OUT/compile_first_step.log"
}
# mixture of experts (issue 40; docs/moe.md). The experts' grouped GEMMs alone: torch._grouped_mm against the Triton
# kernel's tiles, at decode and prefill token counts
moe_kernels() { python3 bench/moe_kernels.py --device cuda --out "$OUT/moe_kernels_h200.json" 2>&1 \
    | tee "$OUT/moe_kernels.log"; }
# rollout tok/s at batch 256: the Qwen3-30B-A3B shape (per experts' kernel, routes recorded or not) against the dense
# model of its active parameters and transformers.generate; MOE_ROLLOUT_BATCH=1024 for a larger batch, where more
# tokens share each expert's read (MOE_ROLLOUT_ARGS="--skip-hf --moe-kernels triton" keeps it to one call;
# --profile adds where the MoE decode step's time goes, kernel by kernel)
moe_rollout() { python3 bench/moe_rollout.py --device cuda --batch "${MOE_ROLLOUT_BATCH:-256}" ${MOE_ROLLOUT_ARGS:-} \
    --out "$OUT/moe_rollout${MOE_ROLLOUT_BATCH:+_b$MOE_ROLLOUT_BATCH}_h200.json" 2>&1 | tee "$OUT/moe_rollout.log"; }
# training-inference mismatch and router agreement, a small Qwen3-MoE with replay off and on beside its dense twin
moe_mismatch() { python3 bench/scale.py --configs moe-small:routes,moe-small:replay,dense-small:default --steps 4 \
    --budget-s 560 --out "$OUT/moe_mismatch_h200.json" 2>&1 | tee "$OUT/moe_mismatch.log"; }
# LoRA GRPO on the Qwen3-30B-A3B shape (16 x 8, <= 512 new tokens), one configuration per call (MOE_GRPO): its
# 57 GiB checkpoint is written to TMPDIR first. The 1-GPU machine's 64 GiB disk does not hold it beside the rest,
# so it goes to RAM (/dev/shm, of 128 GiB) where that has 62 GiB free; else to TMPDIR (the 2-GPU kind's disk
# holds it; one GPU used)
moe_grpo() {
    local tmp="${TMPDIR:-/tmp}" shm
    shm=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
    df -h /dev/shm "$tmp" 2>&1 | tee "$OUT/moe_grpo_disk.log"
    if [ -n "$shm" ] && [ "$shm" -ge 62 ]; then tmp=/dev/shm; fi
    TMPDIR="$tmp" CUDA_VISIBLE_DEVICES=${MOE_GPU:-0} python3 bench/scale.py --configs "${MOE_GRPO:-30b-a3b:lora_replay}" \
        --steps "${MOE_STEPS:-2}" --budget-s 570 --out "$OUT/moe_grpo_h200.json" 2>&1 | tee "$OUT/moe_grpo.log"
}
moe_gpu_tests() { python3 -m pytest -q -m gpu tests/engine/rollout/test_moe_gpu.py \
    tests/engine/train/test_moe_train_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/moe_gpu_tests.log"; }
# long reasoning (issue 42): GRPO on the real model (needs the GGUF) at LONG_RL_LIMIT-token responses (4096 or
# 8192), synchronous steps against partial rollouts; one (limit, mode) fits a call at the defaults, so run
# LONG_RL_MODES=sync and LONG_RL_MODES=partial in two calls (LONG_RL_SET="rollout.max_staleness=2
# rollout.partial_extra_batches=2" LONG_RL_TAG=_s2e2 for a setting: space-separated overrides, its tag in the JSON's
# name), then join them here with `python bench/long_rl.py --merge A.json B.json ... --out bench/results/long_rl_h200.json`
long_rl() {
    local sets=() s
    for s in ${LONG_RL_SET:-}; do sets+=(--set "$s"); done
    python3 bench/long_rl.py --device cuda --model "$GGUF" --max-response "${LONG_RL_LIMIT:-4096}" \
        --modes "${LONG_RL_MODES:-sync}" --budget-s "${LONG_RL_BUDGET_S:-300}" --eval-every-s "${LONG_RL_EVERY_S:-60}" \
        "${sets[@]}" --out "$OUT/long_rl_${LONG_RL_LIMIT:-4096}_${LONG_RL_MODES:-sync}${LONG_RL_TAG:-}.json" 2>&1 \
        | tee "$OUT/long_rl.log"
}
# GRPO at 4,096-token responses against TRL (issue 42): 16 prompts x 8; GRPO_LONG_ONLY=trl in a call of its own.
# TRL's steps take minutes: its run stops after GRPO_LONG_BUDGET_S (default 540) and reports the steps it finished
grpo_long() { python3 bench/grpo_vs_trl.py --device cuda --prompts 16 --n 8 --max-new-tokens 4096 \
    --steps "${GRPO_LONG_STEPS:-4}" --only "${GRPO_LONG_ONLY:-hybridflow}" --child-budget-s "${GRPO_LONG_BUDGET_S:-540}" \
    --out "$OUT/grpo_vs_trl_4096_${GRPO_LONG_ONLY:-hybridflow}.json" 2>&1 | tee "$OUT/grpo_long.log"; }
# the 1.5B shape at 16,384-token responses (issue 42): step time and device peak with the defaults. Random weights
# decode every response to the limit: 16 prompts x 8 is ~2.1M tokens a step, more than a call holds with its first
# step; SCALE_LONG_PROMPTS=2 keeps the same plan (KV cache and micro-batches are sized by length, not by rows)
scale_long() { python3 bench/scale.py --configs 1.5b:default --max-new-tokens 16384 --steps "${SCALE_LONG_STEPS:-3}" \
    --prompts "${SCALE_LONG_PROMPTS:-16}" --budget-s "${SCALE_LONG_BUDGET_S:-540}" --out "$OUT/scale_long_h200.json" 2>&1 \
    | tee "$OUT/scale_long.log"; }
# the Tinker-compatible service (issue 57; docs/tinker.md): sampling through the tinker SDK against our engine, and
# GRPO driven through the SDK against `hybridflow train`, ST_BUDGET_S (default 120) of training each (needs the
# GGUF, model_part1 / model_part2 first, and the SDK's wheels: tinker 0.38 and what the image lacks, carried in .whl2/)
serve_tinker() {
    [ -d .whl2 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl
    python3 bench/serve_tinker.py --device cuda --model "$GGUF" --budget-s "${ST_BUDGET_S:-120}" \
        --out "$OUT/serve_tinker_cuda.json" 2>&1 | tee "$OUT/serve_tinker.log"
}
model_part1() { mkdir -p /tmp/smollm2 && cp .gguf1/part /tmp/smollm2/part1; }
model_part2() { cat /tmp/smollm2/part1 .gguf2/part > "$GGUF" && md5sum "$GGUF"; }
race() { python3 bench/learn_vs_trl.py --device cuda --model "$GGUF" --budget-s "${RACE_BUDGET_S:-180}" \
    --eval-every-s "${RACE_EVERY_S:-15}" --out "$OUT/learn_vs_trl_h200.json" 2>&1 | tee "$OUT/race.log"; }
# what each actor.rollout_correction.mode does to the bf16 mismatch and to learning (issue 23): our side of the
# race once per mode, RACE_BUDGET_S (default 60) of training each, one JSON per mode (the PNGs stay behind)
race_corrections() {
    local mode
    for mode in none token_tis seq_tis token_mis seq_mis; do
        python3 bench/learn_vs_trl.py --device cuda --model "$GGUF" --only hybridflow --budget-s "${RACE_BUDGET_S:-60}" \
            --eval-every-s "${RACE_EVERY_S:-15}" --set actor.rollout_correction.mode=$mode \
            --out "$OUT/correction_$mode.json" 2>&1 | tail -4 | tee -a "$OUT/race_corrections.log"
        rm -f "$OUT/correction_$mode.png"
    done
}
# exact mode (rollout.exact, docs/exact.md), each stage one device call after model_part1 / model_part2 where it
# needs the GGUF. exact_tests: the invariance and bitwise engine-vs-trainer GPU tests (the SmolLM2 bf16
# 64 x 8 x 256 one included); exact_rollout: tokens/s of the exact engine against the default's (target >= 0.7x);
# (with a torch.profiler account of the exact engine's decode at the 0.5B shape); exact_grpo: the 0.5B GRPO step, default then exact, with one mini-batch (the default skips its old-log-prob pass
# too) and with four (exact skips the pass the default runs; target <= 1.15x), 4 JSONs (EXACT_MB=8: the four alone;
# EXACT_PROFILE=1: the exact runs' last step under the profiler, its op table in their JSON); exact_race: our side of
# the learning race with rollout.exact=true, then the default's, RACE_BUDGET_S (default 150) each: the mismatch
# of every step (0 in exact mode) and the two accuracy-against-time curves
# (pytest's cache holds the real model converted from the GGUF: no `-p no:cacheprovider` here)
# (EXACT_K="not smollm2" runs those that need no GGUF, EXACT_K=smollm2 the real model's, in the next call)
exact_tests() { SMOLLM2_GGUF="$GGUF" python3 -m pytest -q -m gpu ${EXACT_K:+-k "$EXACT_K"} tests/engine/test_invariant_ops.py \
    tests/engine/rollout/test_rollout_exact.py 2>&1 | tee "$OUT/exact_tests${EXACT_K:+_${EXACT_K// /_}}.log"; }
exact_rollout() { python3 bench/rollout.py --device cuda --exact --profile --out "$OUT/rollout_exact_h200.json" 2>&1 \
    | tee "$OUT/rollout_exact.log"; }
# the invariant linear at other tilings, SmolLM2 and 0.5B projections at decode and training row counts: time and
# whether the bits change (bench/invariant_gemm.py, ~6 minutes)
# and the per-K and per-shape table it recommends ($OUT/tiles.json: copy it to hybridflow/engine/invariant/tiles.json, then run
# exact_tests, exact_rollout and exact_grpo with it)
invariant_gemm() { python3 bench/invariant_gemm.py --out "$OUT/invariant_gemm_h200.json" --write-table "$OUT/tiles.json" \
    2>&1 | tee "$OUT/invariant_gemm.log"; }
# where exact mode's update time goes (issue 39): the 0.5B update in 16k-token checkpointed micro-batches (as the
# device plan runs 0.5B), compiled, eager and
# exact (eager on the invariant ops), each with a profiler breakdown by kernel family (~2-3 minutes)
exact_update() { python3 bench/train.py --shapes 0.5b --budgets 16384 --compile on,off --exact off,on --checkpointing on --profile \
    --out "$OUT/train_exact_h200.json" 2>&1 | tee "$OUT/exact_update.log"; }
exact_grpo() {
    local mb
    for mb in ${EXACT_MB:-null 8}; do
        python3 bench/grpo_vs_trl.py --device cuda --steps "${EXACT_STEPS:-8}" --only hybridflow \
            --set actor.mini_batch_size=$mb --out "$OUT/grpo_default_mb$mb.json" 2>&1 | tail -3
        python3 bench/grpo_vs_trl.py --device cuda --steps "${EXACT_STEPS:-8}" --only hybridflow \
            --set actor.mini_batch_size=$mb --set rollout.exact=true --against "$OUT/grpo_default_mb$mb.json" \
            ${EXACT_PROFILE:+--profile} \
            --out "$OUT/grpo_exact_mb$mb.json" 2>&1 | tail -4
    done 2>&1 | tee "$OUT/exact_grpo.log"
}
exact_race() {
    local mode
    for mode in exact default; do
        python3 bench/learn_vs_trl.py --device cuda --model "$GGUF" --only hybridflow \
            --budget-s "${RACE_BUDGET_S:-150}" --eval-every-s "${RACE_EVERY_S:-15}" \
            --set rollout.exact=$([ $mode = exact ] && echo true || echo false) \
            --out "$OUT/race_$mode.json" 2>&1 | tail -6 | tee -a "$OUT/exact_race.log"
        rm -f "$OUT/race_$mode.png"
    done
}
# one framework of the race (RACE_ONLY=hybridflow or trl), for a budget too long for both in one call: the
# other runs in the next call while the machine is warm (the GGUF stays), then, here,
# `python bench/learn_vs_trl.py --merge A.json B.json --out bench/results/learn_vs_trl_cuda_<sha>.json`
race_only() { python3 bench/learn_vs_trl.py --device cuda --model "$GGUF" --only "$RACE_ONLY" \
    --budget-s "${RACE_BUDGET_S:-450}" --eval-every-s "${RACE_EVERY_S:-15}" --out "$OUT/learn_vs_trl_$RACE_ONLY.json" \
    2>&1 | tee "$OUT/race_$RACE_ONLY.log"; }
# recipes/multiturn_retry.yaml on the real model, trained end to end for MT_STEPS steps (synthetic GSM8K data)
multiturn_train() {
    local model data=/tmp/mt_data run=/tmp/mt_run
    model=$(python3 -m hybridflow.utils.real_model --gguf "$GGUF" --dtype bf16 | tail -1)
    python3 -m hybridflow.data.gsm8k_synthetic "$data" --n-train 4096 --n-val 128 > /dev/null
    python3 -m hybridflow.cli train --config recipes/multiturn_retry.yaml model.path="$model" \
        data.train_files="$data/train.parquet" data.val_files="$data/test.parquet" actor.lr=5e-6 \
        trainer.total_steps="${MT_STEPS:-20}" trainer.val_every=10 trainer.output_dir="$run" 2>&1 \
        | tee "$OUT/multiturn_train.log"
    cp "$run/metrics.jsonl" "$OUT/multiturn_train_metrics.jsonl"
}
# on-policy distillation (issue 41): the race's GRPO run (150 s) trains the teacher, saved, then 60 s of distilling
# it into the untrained SmolLM2; needs the GGUF (model_part1, model_part2). DISTILL_SWEEP=actor.lr=5e-6,2e-5,5e-5
# distills once per value from the one teacher (~90 s each); DISTILL_SET="teacher.model.compile=false teacher.topk=64"
# (space-separated overrides) applies to every distillation run; DISTILL_BUDGET_S (default 60) is each one's training time
distill() {
    local sets=() s
    for s in ${DISTILL_SET:-}; do sets+=(--distill-set "$s"); done
    python3 bench/distill.py --device cuda --model "$GGUF" ${DISTILL_SWEEP:+--distill-sweep "$DISTILL_SWEEP"} \
        ${DISTILL_BUDGET_S:+--distill-budget-s "$DISTILL_BUDGET_S"} "${sets[@]}" --out "$OUT/distill_h200.json" 2>&1 | tee "$OUT/distill.log"
}
# MT_RUNNERS=8,16: the endpoint once per runner-process count; MT_SWITCH=0.005,0.0005: once per thread switch interval
multiturn() { python3 bench/multiturn.py --device cuda --model "$GGUF" ${MT_RUNNERS:+--runner-processes "$MT_RUNNERS"} \
    ${MT_SWITCH:+--switch-interval "$MT_SWITCH"} \
    --out "$OUT/multiturn_h200.json" 2>&1 \
    | tee "$OUT/multiturn.log"; }
# The OpenAI-compatible endpoint (issue 38). These stages and `multiturn` (its run 4 is the endpoint path) need
# the agents' wheels in .whl/: openai, textarena and their dependencies, as cp312 wheels (docs/agents.md).
# 1,024 trajectories at once through the endpoint: the JSON's endpoint.errors must all be 0
endpoint_1024() { python3 bench/multiturn.py --device cuda --model "$GGUF" --only-endpoint --prompts 256 --n 4 \
    --turn-tokens 64 --out "$OUT/endpoint_1024_h200.json" 2>&1 | tee "$OUT/endpoint_1024.log"; }
# 32 trajectories, one sending a 5 MB message (issue 56): big_message.others_latency_ratio must be <= 2 (also needs
# aiohttp's wheel in .whl/: it serves the endpoint)
endpoint_big() { python3 bench/multiturn.py --device cuda --model "$GGUF" --only-endpoint --prompts 32 --n 1 \
    --big-message-mb 5 --out "$OUT/endpoint_big_h200.json" 2>&1 | tee "$OUT/endpoint_big.log"; }
# GRPO on textarena's GuessTheNumber through the endpoint, ET_STEPS steps at actor.lr ET_LR (a reward curve, JSON
# and PNG)
# (its metrics.jsonl is written to $OUT step by step: a call that runs out of time keeps the finished steps)
endpoint_train() { python3 bench/endpoint_train.py --device cuda --model "$GGUF" --steps "${ET_STEPS:-50}" ${ET_LR:+--lr "$ET_LR"} \
    --run-dir "$OUT/endpoint_train_run" --out "$OUT/endpoint_train_h200.json" 2>&1 | tee "$OUT/endpoint_train.log"; }

setup || exit 1
for stage in "$@"; do
    echo "=== $stage $(date +%T)"
    "$stage"
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
