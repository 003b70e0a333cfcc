#!/usr/bin/env bash
# Session 12, call 2 (planned as call B, ~6 min): where the exact mode's extra update time goes (issue 18: 5.69 vs 3.90 s at
# the 16384-token budget in session 10). One profiled step per mode after one warm-up step, the profiled update
# on the first 64 sequences (8 groups) only, so its trace tabulates in seconds (session 10's whole-update trace
# did not finish in 140 s); the mode off first, for the per-op comparison.
set -u
O=$OUT/cB; mkdir -p "$O"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=16384 rollout.max_num_seqs=auto)
for mode in false true; do
  t0=$SECONDS
  timeout 170 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --steps 1 --profile "$O/px_$mode" \
    --profile-update-seqs 64 --out "$O/px_$mode.json" "${K[@]}" rollout.exact_logprobs=$mode > "$O/px_$mode.log" 2>&1
  echo "exact=$mode rc=$? $((SECONDS-t0))s"; cat "$O/px_$mode/update_slice.json" 2>/dev/null; echo
  head -n 30 "$O/px_$mode/update_ops.txt" 2>/dev/null | cut -c1-200
  tar czf "$OUT/cB_$mode.tgz" -C "$O" "px_$mode" "px_$mode.log" "px_$mode.json" 2>/dev/null; rm -rf "$O/px_$mode"*
done
