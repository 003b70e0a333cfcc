#!/usr/bin/env bash
# Session 29, call 4 (after call 1 again, on a freshly held machine): the spread step's second A/B pair in the
# other order (without FA4, then with: ABBA with call 3's pair), then one profiled spread step each way, to see
# where the update's time goes with FA4. Carry `.whl` and `.fa4b`. ~6 min.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c4; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; source $D/steps.sh
run_step 90 spread_nofa4_b 0 --steps 5 --shape qwen2.5-0.5b --lengths spread
run_step 90 spread_fa4_b 1 --steps 5 --shape qwen2.5-0.5b --lengths spread
run_step 110 spread_prof_fa4 1 --steps 3 --shape qwen2.5-0.5b --lengths spread --profile "$O/prof_fa4"
run_step 100 spread_prof_nofa4 0 --steps 3 --shape qwen2.5-0.5b --lengths spread --profile "$O/prof_nofa4"
summary spread_nofa4_b spread_fa4_b spread_prof_fa4 spread_prof_nofa4
python3 - "$O" <<'PY'
import json, sys
for v in ("fa4", "nofa4"):
    try:
        g = json.load(open(f"{sys.argv[1]}/prof_{v}/update_gaps.json"))
        print(v, "update idle us", round(g["idle_us"]), "of", round(g["window_us"]),
              {k: round(x["us"]) for k, x in list(g["by_annotation"].items())[:8]})
    except Exception as e:  # noqa: BLE001
        print(v, "gaps unreadable", e)
PY
tar czf "$OUT/c4_prof.tgz" -C "$O" prof_fa4 prof_nofa4 2>/dev/null; rm -rf "$O/prof_fa4" "$O/prof_nofa4"
