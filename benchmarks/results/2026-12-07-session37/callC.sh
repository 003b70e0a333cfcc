#!/usr/bin/env bash
# Session 37, call C (carry `.whl`; no FA4): the two-level sampler with 2,048 programs' worth of splits
# (`bench_sampler.py`: the default and half / twice its splits at 128, 256 and 512 rows); the 0.5B fixed
# and spread GRPO steps; on an H200, time left, the 3B fixed step. Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cC; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
timeout 120 python3 benchmarks/bench_sampler.py --rows 128,256,512 --key-sets 8 --out "$O/a_sampler.json" \
  > "$O/a_sampler.log" 2>&1
echo "sampler rc=$? $((SECONDS - T0))s"
python3 - "$O/a_sampler.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()
           if k.endswith("_us") or "mismatch" in k or k in ("rows", "splits_default")})
PY
source $D/steps.sh
run_step 110 b_fixed 0 --steps 3 --shape qwen2.5-0.5b
run_step 110 c_spread 0 --steps 4 --shape qwen2.5-0.5b --lengths spread
summary b_fixed c_spread
if [[ "$GPU" == *H200* ]]; then
  run_step 250 d_fixed_3b 0 --steps 3 --shape qwen2.5-3b
  summary d_fixed_3b
fi
