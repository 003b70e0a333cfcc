#!/usr/bin/env bash
# Session 16, call D: call C repeated (same code, same machine, run to run spread), then both exact modes at
# their own auto token budgets.
set -u
O=$OUT/cD; mkdir -p "$O"
OUT=$O/exact MODES="false true" BUDGET=16384 STEPS=3 CAP_S=140 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 5
OUT=$O/exact_auto MODES="false true" STEPS=3 CAP_S=140 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 5
tar czf "$OUT/cD.tgz" -C "$OUT" cD
