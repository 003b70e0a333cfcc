#!/usr/bin/env bash
# Session 29, call 2 (right after call 1, same held machine): FlashAttention-4 installed (fa4_env.sh), the
# update-attention bench at the 0.5B and 3B heads (FA4 against the aten flash path it replaces), then the
# 0.5B fixed step with FA4 (A) and without (B). Carry `.whl` and `.fa4b` (the cu13 wheel's other 38 MB,
# nvidia-cutlass-dsl-libs-base, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext; cuda-bindings in cb/). ~6 min.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c2; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; source $D/steps.sh
for s in 0.5b 3b; do
  timeout 150 python3 benchmarks/bench_update_attention.py --shape $s --out "$O/attn_$s.json" > "$O/attn_$s.log" 2>&1
  echo "attn $s rc=$? $((SECONDS - T0))s"; tail -4 "$O/attn_$s.log" | cut -c1-1800
done
run_step 120 fixed_fa4 1 --steps 4 --shape qwen2.5-0.5b
run_step 120 fixed_nofa4 0 --steps 4 --shape qwen2.5-0.5b
summary fixed_fa4 fixed_nofa4
