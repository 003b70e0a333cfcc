#!/usr/bin/env bash
# Session 10, call 4: where the exact mode's update time goes (op tables of one profiled step after one
# warm-up step, 0.5B, rollout.exact_logprobs=true at the 16384-token budget of call 3).
set -u
O=$OUT/c4; mkdir -p "$O"
timeout 200 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --steps 1 --profile "$O/px" --out "$O/px.json" \
  actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=16384 rollout.max_num_seqs=auto rollout.exact_logprobs=true \
  > "$O/px.log" 2>&1; echo "rc=$?"; ls "$O/px"
tar czf "$OUT/c4.tgz" -C "$OUT" c4 && rm -rf "$O"
