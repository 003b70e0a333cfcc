#!/usr/bin/env bash
# Session 35, call H (carry `.whl`): what ~260 s of device budget allows: decode attention with the prompt read
# once per window of adjacent slots against the engine's kernel, 0.5B only (call G's first part). ~2 min.
set -u
O=$OUT/cH; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 110 python3 benchmarks/bench_decode_attention.py --default-only --shape qwen2.5-0.5b --out "$O/attn_05b.json" \
  > "$O/attn.log" 2>&1; echo "attn rc=$? $((SECONDS - T0))s"
python3 -c "
import json; d = json.load(open('$O/attn_05b.json')); r = d['prompt_kv_sharing']
print(d['device'], 'live GB', round(d['live_kv_gb'], 4), 'unique GB', round(r['unique_live_kv_gb'], 4))
for lay in ('adjacent', 'scattered'):
    print(lay, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r[lay].items()})" 2>&1 | tail -4
grep -iE "error|Traceback" "$O/attn.log" | head -3
