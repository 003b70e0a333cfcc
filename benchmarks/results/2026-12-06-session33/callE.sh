#!/usr/bin/env bash
# Session 33, call E (what the device budget left after the asks that found no machine): the kernel half of
# a call that also ran the step (not run; removed), carry `.whl`. cuBLAS's split-K partials for the decode step's fc2 and attention output
# projection (reduced inside the add + RMSNorm kernel) against cuBLAS's whole-K GEMM then the add + RMSNorm,
# at the 0.5B shape (256 and 512 rows) and the 3B shape (512 rows); writes the tables of the settings that
# won by >= 3%. ~120-250 s on a fresh machine.
set -u
O=$OUT/cE; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for s in "qwen2.5-0.5b 05b 256,512" "qwen2.5-3b 3b 512"; do set -- $s
  timeout 120 python3 benchmarks/bench_decode_gemm.py --shape $1 --parts fc2,proj --rows $3 --cublas-only \
    --out "$O/gemm_$2.json" --table "$O/table_$2.json" > "$O/gemm_$2.log" 2>&1; echo "$1 rc=$? $((SECONDS - T0))s"
  grep "rows" "$O/gemm_$2.log" | cut -c1-170
  tail -2 "$O/gemm_$2.log" | grep -i error
done
