#!/usr/bin/env bash
# Session 12, call 6: after the exact mode's SwiGLU became one kernel per direction (kernels.swiglu.ExactSwiGLU,
# forward shared with the exact decode step) and the spread workload's EOS table stopped being copied to the
# GPU every decode step. (1) both exact modes at the 16384-token budget (as call 4's c3_exact), (2) 0.5B
# spread at the defaults (call 5's s05), (3) the exact update's op table on 64 sequences (as call 2's cB_true).
set -u
O=$OUT/cD; mkdir -p "$O"
OUT=$O/exact MODES="false true" BUDGET=16384 STEPS=3 CAP_S=125 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 9
grep -h -i "swiglu" "$O"/exact/*.log | sort | uniq -c | head -n 5
tar czf "$OUT/cD_exact.tgz" -C "$O" exact && rm -rf "$O/exact"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
mkdir -p "$O/s05"
timeout 100 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --lengths spread --steps 3 \
  --out "$O/s05/05_spread.json" "${K[@]}" > "$O/s05/05_spread.log" 2>&1; echo "05 spread rc=$?"
grep -v -i warn "$O/s05/05_spread.log" | tail -n 2 | cut -c1-600
tar czf "$OUT/cD_spread.tgz" -C "$O" s05 && rm -rf "$O/s05"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=16384 rollout.max_num_seqs=auto)
timeout 120 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --steps 1 --profile "$O/px_true" \
  --profile-update-seqs 64 --out "$O/px_true.json" "${K[@]}" rollout.exact_logprobs=true > "$O/px_true.log" 2>&1
echo "profile rc=$?"; cat "$O/px_true/update_slice.json" 2>/dev/null; echo
head -n 24 "$O/px_true/update_ops.txt" 2>/dev/null | cut -c1-90,170-200
tar czf "$OUT/cD_profile.tgz" -C "$O" px_true px_true.log px_true.json 2>/dev/null
