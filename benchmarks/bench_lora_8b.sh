#!/usr/bin/env bash
# Issue 22's GPU target: LoRA rank 32 on all linear layers vs full fine-tuning at the Llama-3.1-8B shape
# (random bf16 weights), the GRPO workload of bench_rl_step.py (64 prompts x 8, 256 + 512 tokens, one
# optimizer step per rollout), one H200, both runs in one call at the SAME fixed memory keys (no auto budget:
# session 5's LoRA run let the plan fill the GPU, so its peak said nothing about LoRA):
#   actor.ppo_max_token_len_per_gpu=$BUDGET (7680: what the plan picked for full fine-tuning at 8B),
#   rollout.max_num_seqs=$SLOTS (256 KV-cache slots; kv_cache_tokens follows from it: slots x 768).
# Full fine-tuning adds megatron-core's hybrid CPU optimizer (run_sizes.sh's OFFLOAD_KEYS): its optimizer
# state does not fit one GPU; LoRA keeps its ~0.6 GB of adapter state on the GPU (default backend).
# Writes $OUT/lora_8b.json, $OUT/full_8b.json (bench_rl_step's records: step time, phases, peak allocated
# memory per phase, dry run) and $OUT/lora_8b.md (both rows, the peak ratio, per-phase times); log lora_8b.log.
# One command: bash benchmarks/bench_lora_8b.sh   (~8-9 min: model written once ~20 s; per run load + build
# ~60 s, warm-up step ~100 s, one measured step ~60-90 s; BUDGET_S=540 caps the whole call)
#   CPU smoke: TINY=1 bash benchmarks/bench_lora_8b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/lora_8b}; mkdir -p "$OUT"
STEPS=${STEPS:-2}; BUDGET_S=${BUDGET_S:-540}; BUDGET=${BUDGET:-7680}; SLOTS=${SLOTS:-256}
CAP_LORA=${CAP_LORA:-260}  # the LoRA run's share; full fine-tuning gets what is left
LOG="$OUT/lora_8b.log"; PART_TAIL=4; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
source benchmarks/_parts.sh  # environment, deadline, part(), HYBRID_OPTIM
SHAPE=llama-3.1-8b; W=(--steps "$STEPS"); X=()
FULL=("${HYBRID_OPTIM[@]}")
if [[ ${TINY:-0} == 1 ]]; then
  SHAPE=tiny; BUDGET=${BUDGET_TINY:-96}; SLOTS=4; X=(trainer.gpu_memory_gb=139.8)
  FULL=(actor.optim.backend=megatron)  # the hybrid CPU optimizer steps bf16 weights only; tiny is fp32
  W=(--steps 2 --prompts 4 --n 2 --prompt-len 16 --response-len 8 --micro 4)
fi
LORA=(actor.lora.rank=32 actor.lora.alpha=64
  "actor.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]" actor.optim.lr=1e-5)
SAME=(actor.use_dynamic_bsz=true "actor.ppo_max_token_len_per_gpu=$BUDGET" "rollout.max_num_seqs=$SLOTS"
  trainer.save_final=false trainer.save_on_signal=false "${X[@]}")
rm -f "$OUT/lora_8b.json" "$OUT/full_8b.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$LOG"
part lora "$CAP_LORA" python3 benchmarks/bench_rl_step.py --shape "$SHAPE" "${W[@]}" --out "$OUT/lora_8b.json" \
  "${LORA[@]}" "${SAME[@]}"
part full "$BUDGET_S" python3 benchmarks/bench_rl_step.py --shape "$SHAPE" "${W[@]}" --out "$OUT/full_8b.json" \
  "${FULL[@]}" "${SAME[@]}"
export LORA_8B_COMMAND="STEPS=$STEPS BUDGET=$BUDGET SLOTS=$SLOTS BUDGET_S=$BUDGET_S bash benchmarks/bench_lora_8b.sh"
python3 benchmarks/lora_summary.py "$OUT/lora_8b.json" "$OUT/full_8b.json" "$OUT/lora_8b.md" 2>&1 | tee -a "$LOG"
