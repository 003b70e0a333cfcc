#!/usr/bin/env bash
# Session 33, call B (within 30 s of session 29's call1.sh, which carries `.fa4a`, on the same held machine).
# Carry `.whl`, `.fa4b`'s wheels and `cu13.part_ab` (not `cb/`). cuBLAS's split-K partials for the decode
# step's fc2 and attention output projection (`decode_gemm.splitk_cublas`, reduced inside the add + RMSNorm
# kernel) against cuBLAS's whole-K GEMM then the add + RMSNorm, at the 0.5B and 3B shapes (writes their
# tables); then quack's fused MLP against today's (`bench_quack_mlp.py`). ~200-350 s. Not run in session 33
# (call E ran its first half; the quack bench is still to be measured).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/bench_decode_gemm.py --shape qwen2.5-0.5b --parts fc2,proj --rows 64,128,256,320,384,448,512 \
  --cublas-only --out "$O/gemm_05b.json" --table "$O/table_05b.json" > "$O/gemm_05b.log" 2>&1; echo "0.5B rc=$? $((SECONDS - T0))s"
grep "rows" "$O/gemm_05b.log" | cut -c1-150
timeout 150 python3 benchmarks/bench_decode_gemm.py --shape qwen2.5-3b --parts fc2,proj --rows 128,256,512 \
  --cublas-only --out "$O/gemm_3b.json" --table "$O/table_3b.json" > "$O/gemm_3b.log" 2>&1; echo "3B rc=$? $((SECONDS - T0))s"
grep "rows" "$O/gemm_3b.log" | cut -c1-150
cat "$O/table_05b.json" | python3 -c "import json,sys; print(json.dumps(json.load(sys.stdin)))"
cp "$O/table_05b.json" /tmp/table_05b.json 2>/dev/null; cp "$O/table_3b.json" /tmp/table_3b.json 2>/dev/null
timeout 170 python3 benchmarks/bench_quack_mlp.py --out "$O/quack_mlp.json" > "$O/quack_mlp.log" 2>&1
echo "quack rc=$? $((SECONDS - T0))s"; tail -6 "$O/quack_mlp.log" | cut -c1-400
tail -3 "$O"/*.log | grep -i error | head
