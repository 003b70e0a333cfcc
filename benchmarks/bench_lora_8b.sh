#!/usr/bin/env bash
# Issue 22's GPU target: LoRA rank 32 on all linear layers of the Llama-3.1-8B shape (random bf16 weights),
# the GRPO workload of bench_rl_step.py (64 prompts x 8, 256 + 512 tokens, one optimizer step per rollout),
# on one H200, at the same memory keys as run_sizes.sh (auto token budget / KV slots) but without the
# hybrid CPU optimizer full fine-tuning needed at 8B: the adapters' optimizer state is ~0.6 GB.
# Writes $OUT/lora_8b.json (bench_rl_step's record: step time, peak allocated memory per phase, dry run)
# and $OUT/lora_8b.md (next to full fine-tuning at 8B from benchmarks/results/2026-12-01-h200-session4).
# One command: bash benchmarks/bench_lora_8b.sh  (about 5 min; BUDGET_S=450 caps it).
#   CPU smoke: TINY=1 bash benchmarks/bench_lora_8b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/lora_8b}; mkdir -p "$OUT"
STEPS=${STEPS:-3}; BUDGET_S=${BUDGET_S:-450}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:-}:$PWD
SHAPE=llama-3.1-8b; W=(--steps "$STEPS"); X=()
if [[ ${TINY:-0} == 1 ]]; then
  SHAPE=tiny; W=(--steps 2 --prompts 4 --n 2 --prompt-len 16 --response-len 8 --micro 4); X=(trainer.gpu_memory_gb=139.8)
fi
LORA=(actor.lora.rank=32 actor.lora.alpha=64
  "actor.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]" actor.optim.lr=1e-5)
KEYS=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto
  trainer.save_final=false trainer.save_on_signal=false "${X[@]}")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/lora_8b.log"
echo "== bench_rl_step --shape $SHAPE ${W[*]} ${LORA[*]} ${KEYS[*]}" | tee -a "$OUT/lora_8b.log"
s=$(date +%s)
timeout "$BUDGET_S" python3 benchmarks/bench_rl_step.py --shape "$SHAPE" "${W[@]}" --out "$OUT/lora_8b.json" \
  "${LORA[@]}" "${KEYS[@]}" 2>&1 | grep -v -i -E 'warn|^\s*$' | tee -a "$OUT/lora_8b.log" | tail -n 8
echo "== rc ${PIPESTATUS[0]} in $(($(date +%s) - s)) s" | tee -a "$OUT/lora_8b.log"
python3 benchmarks/lora_summary.py "$OUT/lora_8b.json" "$OUT/lora_8b.md" 2>&1 | tee -a "$OUT/lora_8b.log"
