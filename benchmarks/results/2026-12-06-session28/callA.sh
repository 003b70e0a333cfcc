#!/usr/bin/env bash
# Session 28, call A: the update's attention, varlen (today) against FlexAttention over the packed row, at the
# 0.5B and 3B heads, fixed and spread rows (benchmarks/bench_update_attention.py). Carry `.whl`; ~3 min.
set -u
O=$OUT/cA; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
for s in 0.5b 3b; do
  timeout 240 python3 benchmarks/bench_update_attention.py --shape $s --out "$O/attn_$s.json" > "$O/attn_$s.log" 2>&1
  echo "$s rc=$? $((SECONDS - T0))s"; tail -4 "$O/attn_$s.log" | cut -c1-1500
done
