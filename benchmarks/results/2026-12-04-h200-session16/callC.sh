#!/usr/bin/env bash
# Session 16, call C: call A plus the exact decode step's fused residual add + RMSNorm (batch_invariant.add_rms_norm).
set -u
O=$OUT/cC; mkdir -p "$O"
OUT=$O/exact MODES="false true" BUDGET=16384 STEPS=3 CAP_S=140 bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 9
python3 - "$O/exact/exact_true.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("timing", r["median_after_warmup"]["timing_s"])
g = r.get("exact_gemm", {})
print("batched", g.get("batched"), g.get("batched_call_counts"), "weights", g.get("weights"))
print("trials disagreed:", [t for t in g.get("batched_trials", []) if t["disagreed"]])
PY
tar czf "$OUT/cC.tgz" -C "$OUT" cC
