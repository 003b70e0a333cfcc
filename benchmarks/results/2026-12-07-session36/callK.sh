#!/usr/bin/env bash
# Session 36, call K (carry `.whl`): decode_step_parts.py again after the mask change (the fused decode step
# builds no additive mask where the Triton attention serves): graph kernels and busy time per step. ~60 s.
set -u
O=$OUT/cK; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/decode_step_parts.py --out "$O/a_decode_parts.json" > "$O/a_parts.log" 2>&1
echo "parts rc=$? $((SECONDS - T0))s"; grep -v "^  " "$O/a_parts.log" | grep -v Warning | tail -14 | cut -c1-400
