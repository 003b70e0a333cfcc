#!/usr/bin/env bash
# Session 29, call 8 (after call 1 again): FA4's forward as the decode step's attention against the engine's
# Triton kernel (probe_fa4_decode.py). Carry `.whl` and `.fa4b`. ~1.5 min.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c8; mkdir -p "$O"
source $D/fa4_env.sh
timeout 150 python3 $D/probe_fa4_decode.py "$O/probe_fa4_decode.json" 2>&1 | grep -v Warning | tail -8 | cut -c1-2500
