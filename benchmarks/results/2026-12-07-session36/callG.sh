#!/usr/bin/env bash
# Session 36, call G: within 30 s of session 29's call1.sh (carry `.fa4a`) on the same held machine; carry
# `.whl` and `.fa4b` (its `cb/` moved out). (1) the decode step split at the graph's edge
# (`decode_step_parts.py`: the graph replay against the eager row keys / draw / bookkeeping after it, per
# step); (2) quack's fused-epilogue MLP against today's at update and decode rows (`bench_quack_mlp.py`);
# (3) on an H200 the 3B fixed step with FA4 (issue 16's 3B target, last measured in session 18).
# Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cG; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
timeout 150 python3 benchmarks/decode_step_parts.py --out "$O/a_decode_parts.json" > "$O/a_parts.log" 2>&1
echo "parts rc=$? $((SECONDS - T0))s"; grep -v "^ " "$O/a_parts.log" | tail -12 | cut -c1-300; sed -n '/graph_kernels_us/,$p' "$O/a_parts.log" | head -40 | cut -c1-110
timeout 200 python3 benchmarks/bench_quack_mlp.py --out "$O/b_quack_mlp.json" > "$O/b_quack.log" 2>&1
echo "quack rc=$? $((SECONDS - T0))s"; grep -E "^qwen|Error|error" "$O/b_quack.log" | cut -c1-400 | head -8
source $D/steps.sh
if [[ "$GPU" == *H200* ]]; then
  run_step 250 c_fixed_3b 1 --steps 3 --shape qwen2.5-3b
  summary c_fixed_3b
fi
