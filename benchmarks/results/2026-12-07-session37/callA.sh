#!/usr/bin/env bash
# Session 37, call A (session 36 call H re-run, hoping for an H200) (one call, carry `.whl`; no FA4): (1) the decode step split at the graph's edge with the
# per-slot bookkeeping in torch ops and in kernels.slot_state (`decode_step_parts.py`, A B B A in one process);
# (2) the 0.5B fixed step with the slot kernels off and on; (3) on an H200, time left, the 3B fixed step (issue
# 16's 3B target; session 18 measured it without FA4 too). Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cA; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
timeout 200 python3 benchmarks/decode_step_parts.py --out "$O/a_decode_parts.json" > "$O/a_parts.log" 2>&1
echo "parts rc=$? $((SECONDS - T0))s"; grep -v "^  " "$O/a_parts.log" | grep -v Warning | tail -14 | cut -c1-400
grep -A22 "^profiled_off" "$O/a_parts.log" | cut -c1-120; grep -A30 "^profiled_on" "$O/a_parts.log" | grep -A12 tail_kernels | cut -c1-120
source $D/steps.sh
MEGATRON_RL_SLOT_KERNELS=0 run_step 110 b_fixed_off 0 --steps 3 --shape qwen2.5-0.5b
run_step 110 c_fixed_on 0 --steps 3 --shape qwen2.5-0.5b
summary b_fixed_off c_fixed_on
if [[ "$GPU" == *H200* ]]; then
  run_step 250 d_fixed_3b 0 --steps 3 --shape qwen2.5-3b
  summary d_fixed_3b
fi
