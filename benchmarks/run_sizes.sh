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
# (megatron-core's hybrid-device optimizer; the gradient buffers freed while generating, so the KV cache
# holds every sequence) are added there. TRL: TRL_SIZES, gradient checkpointing on at
# TRL_GC_SIZES; TRL_LATE_SIZES run after every size of ours (kept for the end of the call: skipped when the
# time is spent). Needs the carried wheels (see benchmarks/README.md). Knobs: SIZES, STEPS (3: the first
# is warm-up), TRL_STEPS (2), BUDGET_S (570), CAP_OURS / CAP_TRL (per-part timeouts, s; default per size).
# The session's two device calls (each within 9.5 min; see benchmarks/README.md):
#   A: SIZES='qwen2.5-3b qwen2.5-1.5b qwen2.5-0.5b' TRL_SIZES='qwen2.5-3b' \
#      TRL_LATE_SIZES='qwen2.5-1.5b qwen2.5-0.5b' BUDGET_S=550 bash benchmarks/run_sizes.sh
#   B: SIZES='qwen2.5-7b llama-3.1-8b' TRL_SIZES='' BUDGET_S=550 bash benchmarks/run_sizes.sh
#   CPU smoke: TINY=1 bash benchmarks/run_sizes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
PARTS=${PARTS:-/tmp/run_sizes_parts}; mkdir -p "$PARTS"
SIZES=${SIZES:-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b qwen2.5-7b llama-3.1-8b}
TRL_SIZES=${TRL_SIZES-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b}; TRL_GC_SIZES=${TRL_GC_SIZES-qwen2.5-7b llama-3.1-8b}
TRL_LATE_SIZES=${TRL_LATE_SIZES-}
STEPS=${STEPS:-3}; TRL_STEPS=${TRL_STEPS:-2}; BUDGET_S=${BUDGET_S:-570}
LOG="$OUT/sizes.log"; PART_TAIL=6; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
source benchmarks/_parts.sh  # environment, deadline, part(), HYBRID_OPTIM
OFFLOAD_KEYS=${OFFLOAD_KEYS:-${HYBRID_OPTIM[*]} actor.optim.grad_offload=true trainer.save_final=false trainer.save_on_signal=false}
# per-part caps (s), measured session 4 plus margin: 3 steps of ours at 7-8B took ~255-275 s (random
# weights written and loaded ~45 s, build ~27 s, warm-up step ~85 s: torch.compile and the hybrid-device
# optimizer's first step, which creates its host state), so B fits both sizes in one 570 s call
cap_ours() { case $1 in qwen2.5-7b | llama-3.1-8b) echo 285 ;; qwen2.5-3b) echo 200 ;; *) echo 150 ;; esac; }
cap_trl() { case $1 in qwen2.5-3b | qwen2.5-7b | llama-3.1-8b) echo 200 ;; *) echo 150 ;; esac; }
trl() {  # trl SIZE: TRL GRPOTrainer on SIZE, gradient checkpointing where TRL_GC_SIZES says
  local gc=(); [[ " $TRL_GC_SIZES " == *" $1 "* ]] && gc=(--gradient-checkpointing)
  part "trl_$1" "${CAP_TRL:-$(cap_trl "$1")}" python3 benchmarks/bench_trl_grpo.py --shape "$1" "${T[@]}" "${gc[@]}" \
    --out "$PARTS/trl_${1//[.-]/_}.json"
}
W=(--steps "$STEPS"); T=(--steps "$TRL_STEPS"); X=()
if [[ ${TINY:-0} == 1 ]]; then  # CPU smoke: the tiny shape, tiny sizes, same code paths
  SIZES=tiny; TRL_SIZES=${TRL_SIZES_TINY:-}; TRL_LATE_SIZES=; W=(--steps 2 --prompts 4 --n 2 --prompt-len 16 --response-len 8 --micro 4)
  T=("${W[@]}"); X=(trainer.gpu_memory_gb=139.8)
fi
for S in $SIZES $TRL_LATE_SIZES; do rm -f "$PARTS/ours_${S//[.-]/_}.json" "$PARTS/trl_${S//[.-]/_}.json"; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$LOG"
for S in $SIZES; do
  tag=${S//[.-]/_}
  keys=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto "${X[@]}")
  read -ra extra <<< "${EXTRA_KEYS:-}"; keys+=("${extra[@]}")  # e.g. EXTRA_KEYS="actor.share_prompts=true"
  case $S in qwen2.5-7b | llama-3.1-8b) read -ra more <<< "$OFFLOAD_KEYS"; keys+=("${more[@]}") ;; esac
  part "ours_$S" "${CAP_OURS:-$(cap_ours "$S")}" python3 benchmarks/bench_rl_step.py --shape "$S" "${W[@]}" \
    --out "$PARTS/ours_$tag.json" "${keys[@]}"
  [[ " $TRL_SIZES " == *" $S "* ]] && trl "$S"
  rm -rf "/tmp/bench_${tag}_random"  # the disk holds one 7-8B model at a time
done
for S in $TRL_LATE_SIZES; do trl "$S"; done
ALL=$(printf '%s\n' $SIZES $TRL_LATE_SIZES | sort -u | tr '\n' ' ')
export RUN_SIZES_COMMAND="${EXTRA_KEYS:+EXTRA_KEYS='$EXTRA_KEYS' }SIZES='$SIZES' TRL_SIZES='$TRL_SIZES' TRL_LATE_SIZES='$TRL_LATE_SIZES' STEPS=$STEPS \
TRL_STEPS=$TRL_STEPS BUDGET_S=$BUDGET_S bash benchmarks/run_sizes.sh"
python3 benchmarks/sizes_summary.py "$PARTS" "$OUT" "$ALL" 2>&1 | tee -a "$LOG"
