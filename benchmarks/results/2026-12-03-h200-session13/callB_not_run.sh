#!/usr/bin/env bash
# Session 13, call B: 3B spread at the defaults without the spread benchmark's per-step host copy (session 12's
# 9.49 s had it), then both exact modes at their own auto budgets (as session 12's call 5).
set -u
O=$OUT/cB; mkdir -p "$O"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
mkdir -p "$O/3b_spread"
timeout 175 python3 benchmarks/bench_rl_step.py --shape qwen2.5-3b --lengths spread --steps 3 \
  --out "$O/3b_spread/3b_spread.json" "${K[@]}" > "$O/3b_spread/3b_spread.log" 2>&1; echo "3b spread rc=$?"
grep -v -i warn "$O/3b_spread/3b_spread.log" | tail -n 3 | cut -c1-700
tar czf "$OUT/cB_3b_spread.tgz" -C "$O" 3b_spread && rm -rf "$O/3b_spread"
OUT=$O/exact_auto MODES="false true" STEPS=3 CAP_S=140 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 9
tar czf "$OUT/cB_exact_auto.tgz" -C "$O" exact_auto && rm -rf "$O/exact_auto"
