#!/usr/bin/env bash
# Session 12, call 5: issue 16's 0.5B spread workload at the defaults, then issue 18's both exact modes at their
# own auto token budgets (73,984 tokens off, 52,224 on).
set -u
mkdir -p $OUT/s05
timeout 100 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --lengths spread --steps 3 --out $OUT/s05/05_spread.json \
  actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto > $OUT/s05/05_spread.log 2>&1
echo rc=$?; grep -v -i warn $OUT/s05/05_spread.log | tail -n 2 | cut -c1-600
OUT=$OUT/exact_auto MODES="false true" STEPS=3 CAP_S=140 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 12
