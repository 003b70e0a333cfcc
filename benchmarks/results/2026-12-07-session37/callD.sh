#!/usr/bin/env bash
# Session 37, call D (carry `.whl`; no FA4): issue 16's targets on an H200 at this tree: the 0.5B fixed step,
# the 3B fixed step (last measured in session 18), the 0.5B spread step. Exits at once (rc 3) on any other GPU
# unless ANY=1, so a probe that lands on an H100 costs only the start. Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cD; mkdir -p "$O"; T0=$SECONDS
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" != *H200* && -z "${ANY:-}" ]]; then echo "not an H200: stopping"; exit 3; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
source $D/steps.sh
run_step 110 b_fixed 0 --steps 3 --shape qwen2.5-0.5b
run_step 250 c_fixed_3b 0 --steps 3 --shape qwen2.5-3b
run_step 110 d_spread 0 --steps 4 --shape qwen2.5-0.5b --lengths spread
summary b_fixed c_fixed_3b d_spread
