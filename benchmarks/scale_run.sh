#!/usr/bin/env bash
# Issue 9, part 2: the GSM8K PPO recipe on the Qwen2.5-1.5B shape (random bf16 weights, synthetic
# GSM8K-format prompts), 10 steps each at 1, 2, 4 and 8 GPUs with the same per-GPU batch:
#   1 GPU: TP1xPP1, 2 GPUs: TP2, 4 GPUs: TP2xPP2, 8 GPUs: TP2xPP2xDP2   (16 prompts per GPU)
# then benchmarks/scale_summary.py: tokens/s/GPU, scaling efficiency vs the 1- and 2-GPU runs,
# resharding time and peak memory per GPU -> $OUT/<date>-scale.json.
#   NGPUS="1 2 4 8" OUT=benchmarks/results bash benchmarks/scale_run.sh       (a node with 8 GPUs)
#   TINY=1 NGPUS="1 2 4" bash benchmarks/scale_run.sh                          (CPU smoke, built-in model)
# The GPU box has no megatron-core/hydra: install the carried wheels first (benchmarks/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; NGPUS=${NGPUS:-"1 2 4 8"}; STEPS=${STEPS:-10}; WORK=${WORK:-/tmp/scale}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:-}:$PWD
mkdir -p "$OUT" "$WORK"
if [[ ${TINY:-0} == 1 ]]; then
  MODEL_ARGS=(algorithm=ppo data.max_prompt_length=32); PER_GPU=4; STEPS=${STEPS_TINY:-2}
  EXTRA=(rollout.max_new_tokens=4 actor.ppo_micro_batch_size_per_gpu=2 critic.ppo_micro_batch_size_per_gpu=2)
else
  python3 - "$WORK/model" <<'PY'
import sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                  rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6)
Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
  python3 benchmarks/make_synthetic_gsm8k.py --model-dir "$WORK/model" --data-dir "$WORK/data"
  MODEL_ARGS=(experiment=gsm8k_qwen2_5_0_5b_ppo model.path="$WORK/model"
              data.train_files="$WORK/data/train.parquet" data.val_files=null)
  PER_GPU=16; EXTRA=()
fi
for n in $NGPUS; do
  case $n in 1) tp=1; pp=1;; 2) tp=2; pp=1;; 4) tp=2; pp=2;; 8) tp=2; pp=2;; *) echo "NGPUS: use 1 2 4 8"; exit 2;; esac
  bs=$((PER_GPU * n)); mini=$((bs / 2))
  echo "== $n GPU(s): TP=$tp PP=$pp DP=$((n / tp / pp)), train_batch_size=$bs"
  timeout ${RUN_TIMEOUT:-900} torchrun --nproc-per-node="$n" -m megatron_rl.train "${MODEL_ARGS[@]}" \
    parallel.tensor_model_parallel_size=$tp parallel.pipeline_model_parallel_size=$pp \
    data.train_batch_size=$bs actor.ppo_mini_batch_size=$mini critic.ppo_mini_batch_size=$mini \
    trainer.total_training_steps="$STEPS" trainer.test_freq=-1 trainer.val_before_train=false \
    trainer.logger=[console,jsonl] trainer.output_dir="$WORK/run_$n" "${EXTRA[@]}" 2>&1 | grep -E "^step|error" | cut -c1-300
done
python3 benchmarks/scale_summary.py --work "$WORK" --ngpus $NGPUS --out "$OUT/$(date +%F)-scale.json"
