#!/usr/bin/env bash
# Session 29, call 3 (same held machine, after call 2): the other half of the ABBA on the 0.5B fixed step
# (without FA4, then with), then the spread step with and without. Carry `.whl`. ~7 min.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c3; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; source $D/steps.sh
run_step 120 fixed_nofa4_b 0 --steps 4 --shape qwen2.5-0.5b
run_step 120 fixed_fa4_b 1 --steps 4 --shape qwen2.5-0.5b
run_step 90 spread_fa4 1 --steps 5 --shape qwen2.5-0.5b --lengths spread
run_step 90 spread_nofa4 0 --steps 5 --shape qwen2.5-0.5b --lengths spread
summary fixed_nofa4_b fixed_fa4_b spread_fa4 spread_nofa4
