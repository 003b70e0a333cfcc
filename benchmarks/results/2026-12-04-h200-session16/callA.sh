#!/usr/bin/env bash
# Session 16, call A: the exact mode with the weight with a bias (qkv) batched too, as an fp32-result bmm
# plus the bias in fp32 rounded once (session 15's diagnostic: equal to the 512-row addmm calls on every
# input; baddbmm was not), two agreeing trials per key; both modes at 16384 tokens in one run.
set -u
O=$OUT/cA; mkdir -p "$O"
OUT=$O/exact MODES="false true" BUDGET=16384 STEPS=3 CAP_S=140 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 9
python3 - "$O/exact/exact_true.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("timing", r["median_after_warmup"]["timing_s"])
g = r.get("exact_gemm", {})
print("batched", g.get("batched"), g.get("batched_call_counts"), "weights", g.get("weights"))
print("trials disagreed:", [t for t in g.get("batched_trials", []) if t["disagreed"]])
PY
tar czf "$OUT/cA.tgz" -C "$OUT" cA
