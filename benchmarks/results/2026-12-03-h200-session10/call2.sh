#!/usr/bin/env bash
# Session 10, call 2: the decode-attention kernel's block/warps/stages sweep at the 0.5B and 3B decode shapes,
# and the exact matmul at the 0.5B shape timed from CUDA graphs, with the fixed-shape cuBLAS path
# (batch_invariant.fixed_rows_matmul) as a candidate (its invariance checked on the device).
set -u
O=$OUT/c2; mkdir -p "$O"
run() { local cap=$1 name=$2; shift 2; local t0=$SECONDS; timeout "$cap" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS-t0))s"; tail -n 6 "$O/$name.log" | cut -c1-600; }
run 100 attn05 python3 benchmarks/bench_decode_attention.py --shape qwen2.5-0.5b --out "$O/attn05.json"
run 100 attn3 python3 benchmarks/bench_decode_attention.py --shape qwen2.5-3b --out "$O/attn3.json"
run 120 mm05 python3 benchmarks/bench_exact_matmul.py --shape qwen2.5-0.5b --rows 64,256,512,16384 --out "$O/mm05.json"
tar czf "$OUT/c2.tgz" -C "$OUT" c2 && rm -rf "$O"
