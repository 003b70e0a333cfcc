#!/usr/bin/env bash
# Session 34, call C (carry `.whl`): calls A and B in one, for a machine that may come once. (1) the fused LM
# head + draw against cuBLAS + the sampler at 512 rows (0.5B shape), its tiles; (2) PDL probe; (3) the decode
# graphs checked on the GPU with the fused head and PDL on (bf16); (4) the 0.5B fixed GRPO step, fused head
# with the best tile of (1) (F), without it (P), fused with PDL (X): F P X P F. No FA4. ~9.5 min, guarded.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cC; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 130 python3 benchmarks/bench_head_sampler.py --rows 512 --shapes 896 --out "$O/head.json" > "$O/head.log" 2>&1
echo "head rc=$? $((SECONDS - T0))s"; grep -E "^896 |Error" "$O/head.log" | head -5
BEST=$(python3 - "$O/head.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    ok = [(v, k) for k, v in r.items() if k.startswith("fused_") and k.endswith("_us") and isinstance(v, float)
          and r.get(k[:-3] + "_mismatch_own_logits") == 0]
    v, k = min(ok)
    print(",".join(k[len("fused_"):-3].split("_")))
    for kk, vv in sorted(r.items()):
        if not kk.startswith("fused_") or kk.endswith("_us"):
            print(kk, vv, file=sys.stderr)
except Exception as e:  # noqa: BLE001
    print(f"no tile: {e}", file=sys.stderr)
PY
)
echo "best tile: ${BEST:-none}"; [ -n "$BEST" ] && export MEGATRON_RL_HEAD_SAMPLER_TILE=$BEST
timeout 40 python3 benchmarks/probe_pdl.py --out "$O/pdl.json" > "$O/pdl.log" 2>&1; echo "pdl rc=$? $((SECONDS - T0))s"
grep -E "_us\"|error" "$O/pdl.log" | head -12
MEGATRON_RL_HEAD_SAMPLER=1 MEGATRON_RL_DECODE_PDL=1 timeout 80 python3 benchmarks/check_decode_graphs.py \
  --dtype bfloat16 --out "$O/check.json" > "$O/check.log" 2>&1; echo "check rc=$? $((SECONDS - T0))s"
grep -E "replay|fused_head|one_buffer|mismatched|Error|error" "$O/check.log" | head -12
source $D/steps.sh; GUARD=${GUARD:-585}
ab() { export MEGATRON_RL_HEAD_SAMPLER=$1 MEGATRON_RL_DECODE_PDL=$2; run_step 86 "$3" 0 --steps 3 --shape qwen2.5-0.5b; }
ab 1 0 fused1; ab 0 0 plain1; ab 1 1 pdl1; ab 0 0 plain2; ab 1 0 fused2
summary fused1 plain1 pdl1 plain2 fused2
python3 benchmarks/results/2026-12-07-session34/decode_ms.py "$O" fused1 plain1 pdl1 plain2 fused2
grep -h "failed its trial" "$O"/*.log | sort | uniq -c | head
