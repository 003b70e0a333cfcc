#!/usr/bin/env bash
# Issue 16 items 2-3: the spread-length GRPO workload (bench_rl_step.py / bench_trl_grpo.py --lengths spread:
# 64 prompts x 8, 256-token prompts, responses stopped at fixed-seed log-normal lengths with mean ~40% of
# the 512 cap, the same lengths for ours and TRL) at the Qwen2.5-0.5B and 3B shapes on one GPU, ours with
# packed micro-batches (actor.pack_sequences=true) and padded ones (today), TRL GRPOTrainer in the same run;
# then $OUT/spread.json and $OUT/spread.md: step time, ratio to TRL, padded fraction of the update's
# tokens (measured, and the CPU arithmetic of spread_lengths.py), roofline written out, x roofline.
#
# Parts, most important first (each under a timeout from what is left of BUDGET_S, default 410 s):
# ours 0.5B defaults (prompts shared), TRL 0.5B, ours 3B defaults, TRL 3B, then ours packed (share_prompts=false)
# and padded (share_prompts=false, no packing) at each size.
# Needs the carried wheels (see benchmarks/README.md). Knobs: SIZES, TRL_SIZES and LAYOUT_SIZES (the sizes that
# also run TRL / the packed and padded layouts; default SIZES), STEPS (3: first is warm-up),
# TRL_STEPS (2), BUDGET_S, CAP_TRL (170 s per TRL part).   CPU smoke: TINY=1 bash benchmarks/run_spread.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
PARTS=${PARTS:-/tmp/run_spread_parts}; rm -rf "$PARTS"; mkdir -p "$PARTS"
SIZES=${SIZES:-qwen2.5-0.5b qwen2.5-3b}; TRL_SIZES=${TRL_SIZES-$SIZES}; LAYOUT_SIZES=${LAYOUT_SIZES-$SIZES}; STEPS=${STEPS:-3}; TRL_STEPS=${TRL_STEPS:-2}; BUDGET_S=${BUDGET_S:-410}
LOG="$OUT/spread.log"; PART_TAIL=4; OMP_NUM_THREADS=8
source benchmarks/_parts.sh  # the environment, the deadline (BUDGET_S) and part()
W=(--lengths spread --steps "$STEPS"); T=(--lengths spread --steps "$TRL_STEPS"); X=()
if [[ ${TINY:-0} == 1 ]]; then  # CPU smoke: the tiny shape, tiny sizes, same code paths
  SIZES=tiny; W=(--lengths spread --steps 2 --prompts 4 --n 2 --prompt-len 16 --response-len 8 --micro 4)
  T=("${W[@]}"); X=(trainer.gpu_memory_gb=139.8)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$LOG"
keys=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto "${X[@]}")
for S in $SIZES; do  # the defaults (share_prompts=auto: each prompt once per group where the GPU trial passes)
  tag=${S//[.-]/_}
  part "ours_default_$S" 150 python3 benchmarks/bench_rl_step.py --shape "$S" "${W[@]}" \
    --out "$PARTS/ours_default_$tag.json" "${keys[@]}"
  [[ " $TRL_SIZES " == *" $S "* ]] && part "trl_$S" "${CAP_TRL:-170}" python3 benchmarks/bench_trl_grpo.py --shape "$S" "${T[@]}" --out "$PARTS/trl_$tag.json"
done
for S in $LAYOUT_SIZES; do  # plain packing (no prompt sharing), then today's padded rows, where time is left
  tag=${S//[.-]/_}
  part "ours_packed_$S" 150 python3 benchmarks/bench_rl_step.py --shape "$S" "${W[@]}" \
    --out "$PARTS/ours_packed_$tag.json" "${keys[@]}" actor.pack_sequences=true actor.share_prompts=false
done
for S in $LAYOUT_SIZES; do
  tag=${S//[.-]/_}
  part "ours_padded_$S" 150 python3 benchmarks/bench_rl_step.py --shape "$S" "${W[@]}" \
    --out "$PARTS/ours_padded_$tag.json" "${keys[@]}" actor.share_prompts=false
done
export RUN_SPREAD_COMMAND="SIZES='$SIZES' TRL_SIZES='$TRL_SIZES' LAYOUT_SIZES='$LAYOUT_SIZES' STEPS=$STEPS TRL_STEPS=$TRL_STEPS BUDGET_S=$BUDGET_S bash benchmarks/run_spread.sh"
python3 benchmarks/spread_summary.py "$PARTS" "$OUT" "$SIZES" 2>&1 | tee -a "$LOG"
