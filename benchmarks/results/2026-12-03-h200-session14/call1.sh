#!/usr/bin/env bash
# Session 14, call 1: why session 13's exact run (batched fixed-rows calls) mismatched after step 0.
# (1) batched vs separate 512-row cuBLAS calls at the 0.5B layer shapes on several inputs
# (benchmarks/diag_batched_gemm.py), (2) the exact mode at 16384 tokens with every batched call verified
# against the separate calls (MEGATRON_RL_EXACT_BATCHED=verify), (3) the same with batching off.
set -u
O=$OUT/c1; mkdir -p "$O"
timeout 150 python3 benchmarks/diag_batched_gemm.py --out "$O/diag.json" > "$O/diag.log" 2>&1; echo "diag rc=$?"
grep -v -i warn "$O/diag.log" | cut -c1-220 | tail -n 30
for b in verify off; do
  MEGATRON_RL_EXACT_BATCHED=$b OUT=$O/exact_$b MODES=true BUDGET=16384 STEPS=3 CAP_S=140 \
    bash benchmarks/bench_exact_logprobs.sh 2>&1 | tail -n 3
  python3 - "$O/exact_$b/exact_true.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("mismatch", [s.get("rollout_logprob_mismatch_frac") for s in r["steps"]],
      "step_s", round(r["median_after_warmup"]["step_s"], 3), "timing", r["median_after_warmup"]["timing_s"])
g = r.get("exact_gemm", {})
print("batched", g.get("batched"), g.get("batched_call_counts"))
for t in g.get("batched_trials", []):
    if t["disagreed"]:
        print("  disagreed", t)
PY
done
tar czf "$OUT/c1.tgz" -C "$OUT" c1
