#!/usr/bin/env bash
# Session 38, call F: FP8 decode GEMMs against bf16 at the 0.5B and 3B decode shapes (bench_fp8_decode_gemm.py).
set -u
O=$OUT/cF; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/bench_fp8_decode_gemm.py --out "$O/fp8_gemm.json" 2>&1 | tee "$O/fp8_gemm.log" | grep -v "^{"
