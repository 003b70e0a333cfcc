#!/usr/bin/env bash
# Session 36, call J (carry `.whl`): the sampler's coarse noise filter against the per-element one at 256 and
# 512 rows (`bench_sampler_coarse.py`, A B B A, token mismatches against the eager draw). ~40 s.
set -u
O=$OUT/cJ; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/bench_sampler_coarse.py --out "$O/sampler_coarse.json" > "$O/coarse.log" 2>&1
echo "coarse rc=$? $((SECONDS - T0))s"; grep -v Warn "$O/coarse.log" | tail -6 | cut -c1-900
