#!/usr/bin/env bash
# Session 10, call 3: issue 18's cost at the new exact path (fixed-rows cuBLAS matmul, fused exact RoPE + KV
# write), both modes in one run at one token budget; then issue 16's spread workload at the defaults
# (3B, then 0.5B, ours only: the TRL spread rows are session 8's). Each stage is packed into its own
# $OUT/c3_*.tgz as soon as it ends (the device returns few files, and a cut call keeps what it packed).
set -u
O=$OUT/c3; mkdir -p "$O"
OUT=$O/exact MODES="false true" BUDGET=16384 STEPS=3 CAP_S=125 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 14
tar czf "$OUT/c3_exact.tgz" -C "$O" exact && rm -rf "$O/exact"
OUT=$O/spread3 SIZES="qwen2.5-3b" TRL_SIZES="" LAYOUT_SIZES="" STEPS=3 BUDGET_S=180 bash benchmarks/run_spread.sh 2>&1 | tail -n 8
tar czf "$OUT/c3_spread3.tgz" -C "$O" spread3 && rm -rf "$O/spread3"
OUT=$O/spread05 SIZES="qwen2.5-0.5b" TRL_SIZES="" LAYOUT_SIZES="" STEPS=3 BUDGET_S=110 bash benchmarks/run_spread.sh 2>&1 | tail -n 8
tar czf "$OUT/c3_spread05.tgz" -C "$O" spread05 && rm -rf "$O/spread05"
