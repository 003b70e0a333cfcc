#!/usr/bin/env bash
# Session 38, call A (carry `.whl`): rollout.decode_parts on the GPU. The decode step at 1-4 parts in one process
# (`bench_decode_parts.py`: distinct prompts and 64 x 8 shared, A B C D D C B A), then the 0.5B fixed GRPO step at
# decode_parts 1 and 2 (session 29's `steps.sh`). Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cA; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/bench_decode_parts.py --out "$O/decode_parts.json" > "$O/decode_parts.log" 2>&1
echo "decode_parts rc=$? $((SECONDS - T0))s"; grep -v "^ " "$O/decode_parts.log" | tail -40
source $D/steps.sh
K+=(rollout.decode_parts=2); run_step 120 b_fixed_parts2 0 --steps 3 --shape qwen2.5-0.5b
unset 'K[${#K[@]}-1]'; run_step 120 c_fixed_parts1 0 --steps 3 --shape qwen2.5-0.5b
summary b_fixed_parts2 c_fixed_parts1
