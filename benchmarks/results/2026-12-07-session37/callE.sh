#!/usr/bin/env bash
# Session 37, call E (carry `.whl`): the two-level draw with 1, 2 or 4 blocks a loop step (`unroll`), 4 and
# 8 warps (`bench_sampler.py --rows 256,512`); on an H200 then call D's targets (0.5B fixed, 3B fixed, 0.5B
# spread). Guarded (GUARD, default 570 s).
set -u
O=$OUT/cE; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
timeout 120 python3 benchmarks/bench_sampler.py --rows 256,512 --key-sets 8 --out "$O/a_sampler.json" \
  > "$O/a_sampler.log" 2>&1
echo "sampler rc=$? $((SECONDS - T0))s"
python3 - "$O/a_sampler.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()
           if (k.endswith("_us") and "eager" not in k and "compiled" not in k) or "mismatch" in k or k == "rows"})
PY
if [[ "$GPU" == *H200* ]]; then
  GUARD=$(( ${GUARD:-570} - (SECONDS - T0) )) bash benchmarks/results/2026-12-07-session37/callD.sh
fi
