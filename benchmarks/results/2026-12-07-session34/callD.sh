#!/usr/bin/env bash
# Session 34, call D (carry `.whl`; call C cut to what ~600 s of device budget after ten failed asks allows):
# the fused LM head + draw against cuBLAS + the sampler at 512 rows (0.5B), five tiles; then the 0.5B fixed
# GRPO step with the fused head at the best tile (F) and without (P): F P F, no FA4. ~5.5 min, guarded.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cD; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 90 python3 benchmarks/bench_head_sampler.py --rows 512 --shapes 896 --out "$O/head.json" \
  --tiles "128,64,64,4,3;128,128,64,8,3;64,128,64,4,3;64,256,64,8,3;128,64,64,8,3" > "$O/head.log" 2>&1
echo "head rc=$? $((SECONDS - T0))s"; grep -E "^896 |Error" "$O/head.log" | head -5
BEST=$(python3 - "$O/head.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    print({k: v for k, v in r.items() if not k.startswith("fused_")}, file=sys.stderr)
    for k, v in sorted(r.items()):
        if k.startswith("fused_"):
            print(k, v, file=sys.stderr)
    ok = [(v, k) for k, v in r.items() if k.startswith("fused_") and k.endswith("_us") and isinstance(v, float)
          and r.get(k[:-3] + "_mismatch_own_logits") == 0]
    print(",".join(min(ok)[1][len("fused_"):-3].split("_")))
except Exception as e:  # noqa: BLE001
    print(f"no tile: {e}", file=sys.stderr)
PY
)
echo "best tile: ${BEST:-none}"; [ -n "$BEST" ] && export MEGATRON_RL_HEAD_SAMPLER_TILE=$BEST
source $D/steps.sh; GUARD=${GUARD:-380}
ab() { export MEGATRON_RL_HEAD_SAMPLER=$1; run_step 86 "$2" 0 --steps 3 --shape qwen2.5-0.5b; }
ab 1 fused1; ab 0 plain1; ab 1 fused2
summary fused1 plain1 fused2
python3 benchmarks/results/2026-12-07-session34/decode_ms.py "$O" fused1 plain1 fused2
grep -h "failed its trial" "$O"/*.log | sort | uniq -c | head
