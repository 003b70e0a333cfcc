#!/usr/bin/env bash
# Issue 15 item 5 (+ issue 16's roofline and decode columns): the GRPO workload of bench_rl_step.py
# (64 prompts x 8, 256 + 512 tokens, one optimizer step per rollout, random reward, random bf16 weights)
# at the Qwen2.5-0.5B / 1.5B / 3B / 7B and Llama-3.1-8B shapes on one GPU, ours vs TRL GRPOTrainer in the
# same run where TRL fits, then one JSON and one Markdown table ($OUT/sizes.json, $OUT/sizes.md):
# step time, tokens/s/GPU, ratio to TRL, update MFU, decode tok/s and fraction of the HBM floor, peak
# memory per phase vs the dry run, the roofline step time written out and our step as a multiple of it.
#
# Ours runs at defaults plus the workload and actor.ppo_max_token_len_per_gpu=auto, rollout.max_num_seqs=auto
# (the memory plan picks both); at 7B/8B the actor's optimizer state does not fit one GPU, so OFFLOAD_KEYS
# (megatron-core's hybrid-device optimizer) are added there. TRL: TRL_SIZES, gradient checkpointing on at
# TRL_GC_SIZES. Needs the carried wheels (see benchmarks/README.md). Knobs: SIZES, STEPS (3: first is
# warm-up), TRL_STEPS (2), BUDGET_S (570), CAP_OURS / CAP_TRL (per-part timeouts, s).
#   CPU smoke: TINY=1 bash benchmarks/run_sizes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
PARTS=${PARTS:-/tmp/run_sizes_parts}; mkdir -p "$PARTS"
SIZES=${SIZES:-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b qwen2.5-7b llama-3.1-8b}
TRL_SIZES=${TRL_SIZES-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b}; TRL_GC_SIZES=${TRL_GC_SIZES-qwen2.5-7b llama-3.1-8b}
STEPS=${STEPS:-3}; TRL_STEPS=${TRL_STEPS:-2}; BUDGET_S=${BUDGET_S:-570}
OFFLOAD_KEYS=${OFFLOAD_KEYS:-actor.optim.backend=megatron actor.optim.use_distributed_optimizer=true \
actor.optim.optimizer_cpu_offload=true actor.optim.optimizer_offload_fraction=0.5 \
trainer.save_final=false trainer.save_on_signal=false}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:-}:$PWD
END=$(($(date +%s) + BUDGET_S))
LOG="$OUT/sizes.log"; : > "$LOG"

part() {  # part NAME CAP_S CMD...: run CMD under min(CAP_S, time left - 20 s for the summary)
  local name=$1 cap=$2; shift 2
  local left=$((END - $(date +%s) - 20)); local t=$((cap < left ? cap : left))
  if ((t < 30)); then echo "== $name: skipped, $left s left" | tee -a "$LOG"; return; fi
  echo "== $name (timeout ${t}s): $*" | tee -a "$LOG"
  local s=$(date +%s)
  timeout "$t" "$@" 2>&1 | grep -v -i -E 'warn|^\s*$' | tee -a "$LOG" | tail -n 6
  echo "== $name: rc ${PIPESTATUS[0]} in $(($(date +%s) - s)) s" | tee -a "$LOG"
}
W=(--steps "$STEPS"); T=(--steps "$TRL_STEPS"); X=()
if [[ ${TINY:-0} == 1 ]]; then  # CPU smoke: the tiny shape, tiny sizes, same code paths
  SIZES=tiny; TRL_SIZES=${TRL_SIZES_TINY:-}; W=(--steps 2 --prompts 4 --n 2 --prompt-len 16 --response-len 8 --micro 4)
  T=("${W[@]}"); X=(trainer.gpu_memory_gb=139.8)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$LOG"
for S in $SIZES; do
  tag=${S//[.-]/_}
  keys=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto "${X[@]}")
  case $S in qwen2.5-7b | llama-3.1-8b) read -ra more <<< "$OFFLOAD_KEYS"; keys+=("${more[@]}") ;; esac
  part "ours_$S" "${CAP_OURS:-300}" python3 benchmarks/bench_rl_step.py --shape "$S" "${W[@]}" \
    --out "$PARTS/ours_$tag.json" "${keys[@]}"
  if [[ " $TRL_SIZES " == *" $S "* ]]; then
    gc=(); [[ " $TRL_GC_SIZES " == *" $S "* ]] && gc=(--gradient-checkpointing)
    part "trl_$S" "${CAP_TRL:-240}" python3 benchmarks/bench_trl_grpo.py --shape "$S" "${T[@]}" "${gc[@]}" \
      --out "$PARTS/trl_$tag.json"
  fi
  rm -rf "/tmp/bench_${tag}_random"  # the disk holds one 7-8B model at a time
done
export RUN_SIZES_COMMAND="SIZES='$SIZES' TRL_SIZES='$TRL_SIZES' STEPS=$STEPS TRL_STEPS=$TRL_STEPS BUDGET_S=$BUDGET_S bash benchmarks/run_sizes.sh"
python3 benchmarks/sizes_summary.py "$PARTS" "$OUT" "$SIZES" 2>&1 | tee -a "$LOG"
