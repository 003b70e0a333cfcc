# Sourced by run_all.sh and run_sizes.sh (not run on its own): the environment every benchmark part runs
# in, the call's deadline and part(), which runs one part under the time the call has left.
# Before sourcing set BUDGET_S (seconds for the whole call), LOG (the call's log, truncated here) and
# optionally PART_TAIL (lines of each part's output echoed to the console, default 15) and OMP_NUM_THREADS.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
# NVLink multicast stays off: the lent machines do not support it (see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:-}:$PWD
# megatron-core's hybrid-device optimizer: what full fine-tuning of a 7B-8B model needs on one H200 (its
# fp32 state does not fit beside the weights); run_sizes.sh and bench_lora_8b.sh add it at those sizes
HYBRID_OPTIM=(actor.optim.backend=megatron actor.optim.use_distributed_optimizer=true
  actor.optim.optimizer_cpu_offload=true actor.optim.optimizer_offload_fraction=0.5)
END=$(($(date +%s) + BUDGET_S))
: > "$LOG"

part() {  # part NAME CAP_S CMD...: run CMD under min(CAP_S, time left - 20 s for the summary)
  local name=$1 cap=$2; shift 2
  local left=$((END - $(date +%s) - 20)); local t=$((cap < left ? cap : left))
  if ((t < 30)); then echo "== $name: skipped, $left s left" | tee -a "$LOG"; return; fi
  echo "== $name (timeout ${t}s): $*" | tee -a "$LOG"
  local s=$(date +%s)
  timeout "$t" "$@" 2>&1 | awk 'tolower($0) ~ /unusable/ || (tolower($0) !~ /warn/ && $0 !~ /^[[:space:]]*$/)' | tee -a "$LOG" | tail -n "${PART_TAIL:-15}"
  echo "== $name: rc ${PIPESTATUS[0]} in $(($(date +%s) - s)) s" | tee -a "$LOG"
}
