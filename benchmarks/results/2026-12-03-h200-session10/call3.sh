#!/usr/bin/env bash
# Session 10, call 3: issue 18's cost at the new exact path (fixed-rows cuBLAS matmul, fused exact RoPE + KV
# write), both modes in one run at one token budget; then issue 16's spread workload at the defaults
# (0.5B and 3B, ours only: the TRL spread rows are session 8's). Outputs packed into $OUT/c3.tgz.
set -u
O=$OUT/c3; mkdir -p "$O"
OUT=$O/exact MODES="false true" BUDGET=16384 STEPS=3 CAP_S=130 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 14
OUT=$O/spread SIZES="qwen2.5-0.5b qwen2.5-3b" TRL_SIZES="" LAYOUT_SIZES="" STEPS=3 BUDGET_S=290 bash benchmarks/run_spread.sh 2>&1 | tail -n 12
tar czf "$OUT/c3.tgz" -C "$OUT" c3 && rm -rf "$O"
