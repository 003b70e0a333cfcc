#!/usr/bin/env bash
# One GPU session (2 x H200): (1) Qwen2.5-0.5B-shape logits at TP=2 vs transformers; (2) the GSM8K GRPO
# recipe for a few steps on that model with synthetic GSM8K-format data. Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=/tmp/qwen2_5_0_5b_random; DATA=/tmp/gsm8k_synth
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 WANDB_MODE=offline
torchrun --nproc-per-node=2 benchmarks/check_qwen_logits.py --path $MODEL --out "$OUT/qwen_tp2_logits.json" 2>&1 | tail -40
python benchmarks/make_synthetic_gsm8k.py --model-dir $MODEL --data-dir $DATA
timeout ${RECIPE_TIMEOUT:-420} torchrun --nproc-per-node=2 -m megatron_rl.train experiment=gsm8k_qwen2_5_0_5b_grpo \
  model.path=$MODEL data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet \
  trainer.output_dir=/tmp/gsm8k_grpo trainer.logger=[console,jsonl] trainer.total_training_steps=${STEPS:-3} \
  trainer.test_freq=-1 trainer.val_before_train=false ${RECIPE_OVERRIDES:-} 2>&1 | grep -v Warning | tail -40
if [ -n "${SP_STEPS:-}" ]; then  # the same recipe at TP=2 with sequence parallelism
  timeout 240 torchrun --nproc-per-node=2 -m megatron_rl.train experiment=gsm8k_qwen2_5_0_5b_grpo \
    model.path=$MODEL data.train_files=$DATA/train.parquet trainer.output_dir=/tmp/gsm8k_grpo_sp \
    trainer.logger=[console,jsonl] trainer.total_training_steps=$SP_STEPS trainer.test_freq=-1 \
    trainer.val_before_train=false parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true \
    ${RECIPE_OVERRIDES:-} 2>&1 | grep -v Warning | tail -20
  cp /tmp/gsm8k_grpo_sp/metrics.jsonl "$OUT/gsm8k_grpo_tp2_sp_metrics.jsonl" 2>/dev/null
  cp /tmp/gsm8k_grpo_sp/error_rank0.log "$OUT/gsm8k_grpo_tp2_sp_error.log" 2>/dev/null
fi
cp /tmp/gsm8k_grpo/metrics.jsonl "$OUT/gsm8k_grpo_metrics.jsonl" 2>/dev/null
cp /tmp/gsm8k_grpo/error_rank0.log "$OUT/gsm8k_grpo_error.log" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
