#!/usr/bin/env bash
# Session 34, call B (carry `.whl`): on one machine, the decode graphs checked on the GPU with the fused LM head
# and PDL on (replays equal the eager step, bf16; tokens against an engine without graphs), then the 0.5B
# fixed GRPO step with the LM head fused into the draw (MEGATRON_RL_HEAD_SAMPLER=1), without it (=0), and
# fused with PDL launches (MEGATRON_RL_DECODE_PDL=1), in the order F P X X P F; no FA4 (the update's
# attention does not touch the decode step). ~9.5 min; the guard skips what would not fit.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
MEGATRON_RL_HEAD_SAMPLER=1 MEGATRON_RL_DECODE_PDL=1 timeout 90 python3 benchmarks/check_decode_graphs.py \
  --dtype bfloat16 --out "$O/check.json" > "$O/check.log" 2>&1; echo "check rc=$? $((SECONDS - T0))s"
grep -E "replay|fused_head|one_buffer|mismatched|Error|error" "$O/check.log" | head -12
source $D/steps.sh; GUARD=${GUARD:-585}
ab() { export MEGATRON_RL_HEAD_SAMPLER=$1 MEGATRON_RL_DECODE_PDL=$2; run_step 88 "$3" 0 --steps 3 --shape qwen2.5-0.5b; }
ab 1 0 fused1; ab 0 0 plain1; ab 1 1 pdl1; ab 1 1 pdl2; ab 0 0 plain2; ab 1 0 fused2
summary fused1 plain1 pdl1 pdl2 plain2 fused2
python3 - "$O" <<'PY'
import json, sys
for f in ("fused1", "plain1", "pdl1", "pdl2", "plain2", "fused2"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{f}.json"))
        print(f, "decode ms", [round(s["decode"]["ms_per_decode_step"], 4) for s in d["steps"]],
              "hbm %", d["median_after_warmup"].get("decode_fraction_of_hbm_floor_this_gpu"))
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
PY
grep -h "failed its trial" "$O"/*.log | sort | uniq -c | head
