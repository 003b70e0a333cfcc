#!/usr/bin/env bash
# Session 38, call E: within 30 s of session 29's call1.sh (carry `.fa4a`) on the same held machine; carry `.whl`
# and `.fa4b`. Issue 16's 0.5B targets with FlashAttention-4 at session 37's code (the code this session leaves):
# the 0.5B fixed and spread steps. Stops at once unless the GPU is an H200. Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cE; mkdir -p "$O"; T0=$SECONDS
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" != *H200* && -z "${ANY:-}" ]]; then echo "not an H200: stopping"; exit 3; fi
source $D/fa4_env.sh
source $D/steps.sh
run_step 120 a_fixed_fa4 1 --steps 3 --shape qwen2.5-0.5b
run_step 120 b_spread_fa4 1 --steps 4 --shape qwen2.5-0.5b --lengths spread
summary a_fixed_fa4 b_spread_fa4
