#!/usr/bin/env bash
# Session 38, call B (carry `.whl`): rollout.cascade_attention. The decode-attention kernel alone (own copies /
# the lead's copy / prompt tiles), the engine's decode step off / on (64 x 8, A B B A), then the 0.5B fixed GRPO
# step with cascade on and off, and the 3B fixed step with it on. Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for s in qwen2.5-0.5b qwen2.5-3b; do
  timeout 60 python3 benchmarks/bench_decode_attention.py --shape $s --default-only --out "$O/attn_$s.json" 2>&1 | tail -1
done; echo "kernel $((SECONDS - T0))s"
timeout 150 python3 benchmarks/bench_cascade_attention.py --out "$O/cascade.json" > "$O/cascade.log" 2>&1
echo "cascade rc=$? $((SECONDS - T0))s"; grep -v "Warning\|warn" "$O/cascade.log" | tail -22
source $D/steps.sh
K+=(rollout.cascade_attention=true); run_step 110 b_fixed_on 0 --steps 3 --shape qwen2.5-0.5b
run_step 150 d_fixed_3b_on 0 --steps 3 --shape qwen2.5-3b
unset 'K[${#K[@]}-1]'; run_step 110 c_fixed_off 0 --steps 3 --shape qwen2.5-0.5b
summary b_fixed_on c_fixed_off d_fixed_3b_on
