#!/usr/bin/env bash
# Session 29, call 6 (after call 1 again, on a freshly held machine): the spread step's A/B once more, with 7
# steps a run (6 timed) in the order A B B A (A: with FA4), because calls 3 and 4 left it inside the noise.
# Carry `.whl` and `.fa4b`. ~6 min.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c6; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; source $D/steps.sh
run_step 110 spread7_fa4_a 1 --steps 7 --shape qwen2.5-0.5b --lengths spread
run_step 110 spread7_nofa4_a 0 --steps 7 --shape qwen2.5-0.5b --lengths spread
run_step 110 spread7_nofa4_b 0 --steps 7 --shape qwen2.5-0.5b --lengths spread
run_step 110 spread7_fa4_b 1 --steps 7 --shape qwen2.5-0.5b --lengths spread
summary spread7_fa4_a spread7_nofa4_a spread7_nofa4_b spread7_fa4_b
