#!/usr/bin/env bash
# Session 38, call C (carry `.whl`): the prefix kernel's key block / warps / stages (bench_decode_attention's
# prompt_kv_sharing rows, 0.5B and 3B shapes): the cascade against the one pass.
set -u
O=$OUT/cC; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for s in qwen2.5-0.5b qwen2.5-3b; do
  timeout 150 python3 benchmarks/bench_decode_attention.py --shape $s --default-only --out "$O/attn_$s.json" > "$O/attn_$s.log" 2>&1
  python3 - "$O/attn_$s.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["prompt_kv_sharing"]
for lay in ("adjacent", "scattered"):
    r = d[lay]; print(lay, "own", round(r["us_own_copies"], 1), "shared", round(r["us_shared"], 1), "cascade", round(r["us_cascade"], 1))
    for k, v in sorted(r["prefix_sweep"].items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list) else 1e9):
        print("  ", k, v)
PY
done
