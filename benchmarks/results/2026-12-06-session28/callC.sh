#!/usr/bin/env bash
# Session 28, call C: the attention bench again with the block mask built once (call A's flex timings included
# a 2 ms mask build per call), then session 27's callX.sh without its 3B parts (0.5B fixed and spread with the
# machine's measured rates; the profiled 0.5B fixed step). Carry `.whl`; ~6 min.
set -u
mkdir -p "$OUT/cC"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 benchmarks/bench_update_attention.py --shape 0.5b --out "$OUT/cC/attn_0.5b.json" > "$OUT/cC/attn_0.5b.log" 2>&1
echo "attn rc=$?"; tail -3 "$OUT/cC/attn_0.5b.log" | cut -c1-1200
SKIP_3B=1 GUARD=480 bash benchmarks/results/2026-12-06-session27/callX.sh
