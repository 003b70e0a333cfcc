#!/usr/bin/env bash
# Session 37, call F (carry `.whl`): the 0.5B fixed GRPO step at the session's final sampler (the review's
# fixes in), checking that the Triton sampler's start-up trial passes on the GPU (no fallback warning).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cF; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
source $D/steps.sh
run_step 120 a_fixed 0 --steps 3 --shape qwen2.5-0.5b
summary a_fixed
grep -i "failed its trial\|falls back\|fallback" "$O/a_fixed.log" | head -5; echo "trial warnings: $(grep -ci 'failed its trial' "$O/a_fixed.log")"
