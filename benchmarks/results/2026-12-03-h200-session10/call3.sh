#!/usr/bin/env bash
# Session 10, call 3: issue 18's cost at the new exact path (fixed-rows cuBLAS matmul, fused exact RoPE + KV
# write), both modes in one run at one token budget; then issue 16 at 3B at the defaults after the CPU-side
# fixes (shared-prompt layout in vector ops, build_batch): the fixed workload, then the spread one.
# Each stage is packed into its own $OUT/c3_*.tgz as soon as it ends (a cut call keeps what it packed).
set -u
O=$OUT/c3; mkdir -p "$O"
OUT=$O/exact MODES="false true" BUDGET=16384 STEPS=3 CAP_S=125 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 14
tar czf "$OUT/c3_exact.tgz" -C "$O" exact && rm -rf "$O/exact"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
for L in ${LENGTHS:-fixed}; do  # LENGTHS="fixed spread" with device time for both
  mkdir -p "$O/3b_$L"
  timeout 175 python3 benchmarks/bench_rl_step.py --shape qwen2.5-3b --lengths $L --steps 3 \
    --out "$O/3b_$L/3b_$L.json" "${K[@]}" > "$O/3b_$L/3b_$L.log" 2>&1; echo "3b $L rc=$?"
  grep -v -i warn "$O/3b_$L/3b_$L.log" | tail -n 3 | cut -c1-700
  tar czf "$OUT/c3_3b_$L.tgz" -C "$O" "3b_$L" && rm -rf "$O/3b_$L"
done
