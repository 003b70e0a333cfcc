#!/usr/bin/env bash
# Issue 6: the GSM8K GRPO recipe (Qwen2.5-0.5B shape, random bf16 weights, synthetic GSM8K-format data) for
# STEPS steps on NGPU GPUs, its dry-run estimate for the same config, and the comparison
# ($OUT/dry_run_vs_measured.json). Extra Hydra overrides in OVERRIDES. CPU smoke: TINY=1 (tiny model).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; NGPU=${NGPU:-1}; STEPS=${STEPS:-2}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/qwen2_5_0_5b_random}; DATA=/tmp/gsm8k_synth; RUN=${RUN:-/tmp/recipe_memory}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 WANDB_MODE=disabled PYTHONPATH=${PYTHONPATH:-}:$PWD
rm -rf "$RUN"
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_rl_step import prepare; \
prepare('$MODEL', '/tmp/recipe_memory_prompts', 'tiny' if ${TINY:-0} == 1 else 'qwen2.5-0.5b', 8, 16)"
python3 benchmarks/make_synthetic_gsm8k.py --model-dir "$MODEL" --data-dir $DATA \
  --vocab-size "$(python3 -c "import json; print(json.load(open('$MODEL/config.json'))['vocab_size'])")"
ARGS=(experiment=gsm8k_qwen2_5_0_5b_grpo model.path="$MODEL" data.train_files=$DATA/train.parquet
  data.val_files=$DATA/test.parquet trainer.output_dir="$RUN" "trainer.logger=[console,jsonl]"
  trainer.total_training_steps="$STEPS" trainer.test_freq=-1 trainer.val_before_train=false trainer.save_freq=-1
  ${OVERRIDES:-})
torchrun --nproc-per-node="$NGPU" -m megatron_rl.train "${ARGS[@]}" trainer.dry_run=true 2>&1 | tail -20
torchrun --nproc-per-node="$NGPU" -m megatron_rl.train "${ARGS[@]}" 2>&1 | grep -v -i warn | tail -20
cp "$RUN/metrics.jsonl" "$OUT/recipe_memory_metrics.jsonl"; cp "$RUN/dry_run.json" "$OUT/recipe_memory_dry_run.json"
python3 benchmarks/dry_run_vs_measured.py --dry "$RUN/dry_run.json" --metrics "$RUN/metrics.jsonl" \
  --out "$OUT/dry_run_vs_measured.json"
