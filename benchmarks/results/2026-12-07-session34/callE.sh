#!/usr/bin/env bash
# Session 34, call E (carry `.whl`; what ~340 s of device budget after thirteen failed asks allows): the fused
# LM head + draw against cuBLAS + the sampler at 512 rows (0.5B), five tiles, and the PDL probe. ~2.5 min.
set -u
O=$OUT/cE; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 110 python3 benchmarks/bench_head_sampler.py --rows 512 --shapes 896 --out "$O/head.json" \
  --tiles "128,64,64,4,3;128,128,64,8,3;64,128,64,4,3;64,256,64,8,3;128,64,64,8,3" > "$O/head.log" 2>&1
echo "head rc=$? $((SECONDS - T0))s"; grep -E "^896 |Error" "$O/head.log" | head -5
python3 -c "
import json; r = json.load(open('$O/head.json'))['results'][0]
print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})"
timeout 40 python3 benchmarks/probe_pdl.py --out "$O/pdl.json" > "$O/pdl.log" 2>&1; echo "pdl rc=$? $((SECONDS - T0))s"
grep -E "_us\"|error" "$O/pdl.log" | head -12
