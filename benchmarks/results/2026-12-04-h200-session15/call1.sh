#!/usr/bin/env bash
# Session 15, call 1: the exact mode with the batched fixed-rows calls for bias-free weights only (the qkv
# weight, which has a bias, always on the separate addmm calls; two agreeing trials per key before a batched
# call serves), both modes at 16384 tokens in one run; first the batched-GEMM diagnostic with 3 inputs per
# shape, which now also tries the weight with a bias through fp32-result GEMMs (bmm/mm out_dtype=float32,
# bias added in fp32) and times each variant.
set -u
O=$OUT/c1; mkdir -p "$O"
timeout 110 python3 benchmarks/diag_batched_gemm.py --inputs 3 --out "$O/diag.json" > "$O/diag.log" 2>&1; echo "diag rc=$?"
grep -v -i warn "$O/diag.log" | cut -c1-300 | tail -n 30
OUT=$O/exact MODES="false true" BUDGET=16384 STEPS=3 CAP_S=140 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 9
python3 - "$O/exact/exact_true.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("timing", r["median_after_warmup"]["timing_s"])
g = r.get("exact_gemm", {})
print("batched", g.get("batched"), g.get("batched_call_counts"), "weights", g.get("weights"))
print("trials disagreed:", [t for t in g.get("batched_trials", []) if t["disagreed"]])
PY
tar czf "$OUT/c1.tgz" -C "$OUT" c1
