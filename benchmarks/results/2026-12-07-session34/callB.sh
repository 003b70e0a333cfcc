#!/usr/bin/env bash
# Session 34, call B (carry `.whl`): the 0.5B fixed GRPO step with the LM head fused into the draw (the default
# now) and without it (MEGATRON_RL_HEAD_SAMPLER=0), A B B A on one machine, no FA4 (the update's attention
# does not touch the decode step); decode ms a step and the step. ~6 min.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
source $D/steps.sh; GUARD=${GUARD:-560}
export MEGATRON_RL_HEAD_SAMPLER=1; run_step 100 fused1 0 --steps 3 --shape qwen2.5-0.5b
export MEGATRON_RL_HEAD_SAMPLER=0; run_step 100 plain1 0 --steps 3 --shape qwen2.5-0.5b
export MEGATRON_RL_HEAD_SAMPLER=0; run_step 100 plain2 0 --steps 3 --shape qwen2.5-0.5b
export MEGATRON_RL_HEAD_SAMPLER=1; run_step 100 fused2 0 --steps 3 --shape qwen2.5-0.5b
export MEGATRON_RL_HEAD_SAMPLER=1; run_step 90 spread_fused 0 --steps 4 --shape qwen2.5-0.5b --lengths spread
summary fused1 plain1 plain2 fused2 spread_fused
python3 - "$O" <<'PY'
import json, sys
for f in ("fused1", "plain1", "plain2", "fused2", "spread_fused"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{f}.json"))
        print(f, "decode ms", [round(s["decode"]["ms_per_decode_step"], 4) for s in d["steps"]],
              "hbm %", d["median_after_warmup"].get("decode_fraction_of_hbm_floor_this_gpu"))
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
PY
grep -h "head_sampler\|fused LM head" "$O"/*.log | sort | uniq -c | head
