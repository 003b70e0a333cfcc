#!/usr/bin/env bash
# Session 16, call B: where the exact update's time goes now that every linear's whole 512-row calls run
# batched: one profiled step per mode at the 16384-token budget (the update of its first 64 sequences).
set -u
O=$OUT/cB; mkdir -p "$O"
for mode in false true; do
  timeout 150 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --steps 2 --out "$O/px_$mode/bench.json" \
    --profile "$O/px_$mode" --profile-update-seqs 64 actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=16384 \
    rollout.max_num_seqs=auto rollout.exact_logprobs=$mode > "$O/px_$mode.log" 2>&1; echo "mode $mode rc=$?"
  cat "$O/px_$mode/update_slice.json"; echo
  head -n 30 "$O/px_$mode/update_ops.txt" | cut -c1-92,150-175
  tail -n 3 "$O/px_$mode/update_ops.txt"
  head -n 16 "$O/px_$mode/generate_ops.txt" | cut -c1-92,150-175; tail -n 2 "$O/px_$mode/generate_ops.txt"
done
tar czf "$OUT/cB.tgz" -C "$OUT" cB
