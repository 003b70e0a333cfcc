#!/usr/bin/env bash
# Session 39, call A (carry `.whl`; any GPU): the 0.5B fixed step (5 steps) and the spread step with the host
# timeline of bench_rl_step.py (where the step's time outside generation and the update goes). Guarded (GUARD,
# default 560 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cA; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
source $D/steps.sh
run_step 140 a_fixed 0 --steps 5 --shape qwen2.5-0.5b
run_step 110 b_spread 0 --steps 5 --shape qwen2.5-0.5b --lengths spread
summary a_fixed b_spread
python3 - "$O" <<'PY'
import json, sys
for f in ("a_fixed", "b_spread"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{f}.json"))
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e); continue
    for r in d["steps"]:
        t = r["timing_s"]; tl = r["host_timeline"]
        out = r["step_s"] - t["gen"] - t["update_actor"]
        print(f, r["step"], round(r["step_s"], 3), "outside_ms", round(out * 1e3, 1), "uncovered_ms", tl["uncovered_ms"])
        print("   ", [(n, a, b) for n, a, b in tl["spans_ms"] if n not in ("_score", "compute_advantages")])
PY
