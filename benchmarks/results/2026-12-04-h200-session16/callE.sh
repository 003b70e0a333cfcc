#!/usr/bin/env bash
# Session 16, call E: the spread-length workload (issue 16) at 0.5B and 3B with the defaults of the size table
# (dynamic batch size, auto token budget, auto max_num_seqs), rollout.exact_logprobs off.
set -u
O=$OUT/cE; mkdir -p "$O"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
for shape in qwen2.5-0.5b qwen2.5-3b; do
  mkdir -p "$O/$shape"
  timeout 200 python3 benchmarks/bench_rl_step.py --shape $shape --lengths spread --steps 3 \
    --out "$O/$shape/spread.json" "${K[@]}" > "$O/$shape/spread.log" 2>&1; echo "$shape spread rc=$?"
  grep -v -i warn "$O/$shape/spread.log" | tail -n 3 | cut -c1-600
done
tar czf "$OUT/cE.tgz" -C "$OUT" cE
