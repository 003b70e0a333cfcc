#!/usr/bin/env bash
# Session 29, call 5 (same held machine, after call 4): the 3B fixed step with FA4 and without (its update
# attention: head dim 128, where the bench gained most). Carry `.whl`. ~6 min.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c5; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; source $D/steps.sh
run_step 170 fixed_3b_fa4 1 --steps 3 --shape qwen2.5-3b
run_step 170 fixed_3b_nofa4 0 --steps 3 --shape qwen2.5-3b
summary fixed_3b_fa4 fixed_3b_nofa4
