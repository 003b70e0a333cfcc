#!/usr/bin/env bash
# Session 35, call F: within 30 s of session 29's call1.sh (carry `.fa4a`) on the same held machine; carry
# `.whl` and `.fa4b` (its `cb/` moved out: the device has cuda.bindings). (1) (call I ran diag_head.py, the
# fused LM head's split, so it is gone from here); (2) quack's fused-epilogue MLP
# against today's at update and decode rows (bench_quack_mlp.py); (3) on an H200 the 3B fixed step with FA4
# (issue 16's 3B target, last measured in session 18), on an H100 the 0.5B fixed step profiled (the decode
# step's kernel table at HEAD). ~7-8 min, guarded (GUARD, default 570 s). Not run in session 35.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cF; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
timeout 200 python3 benchmarks/bench_quack_mlp.py --out "$O/quack_mlp.json" > "$O/diag.log" 2>&1
echo "quack rc=$? $((SECONDS - T0))s"; grep -E "^qwen|Error|error" "$O/diag.log" | cut -c1-400 | head -8
source $D/steps.sh
if [[ "$GPU" == *H200* ]]; then
  run_step 250 fixed_3b 1 --steps 3 --shape qwen2.5-3b
  summary fixed_3b
elif (( SECONDS - T0 + 200 < ${GUARD:-570} )); then
  timeout 200 python3 benchmarks/bench_rl_step.py --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" \
    --profile "$O/prof" "${K[@]}" > "$O/prof.log" 2>&1; echo "prof rc=$? $((SECONDS - T0))s"
  head -45 "$O/prof/generate_ops.txt" | cut -c1-90,150-170
  tar czf "$O/prof.tgz" -C "$O" prof && rm -rf "$O/prof"
fi
