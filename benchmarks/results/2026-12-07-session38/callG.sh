#!/usr/bin/env bash
# Session 38, call G (carry `.whl`): Python's garbage collector in the 0.5B fixed GRPO step: trainer.gc_freeze
# false, then true (bench_rl_step.py records the collector's seconds a step, `gc_s`). Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cG; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
source $D/steps.sh
K+=(trainer.gc_freeze=false); run_step 120 a_fixed_nofreeze 0 --steps 4 --shape qwen2.5-0.5b
unset 'K[${#K[@]}-1]'; run_step 120 b_fixed_freeze 0 --steps 4 --shape qwen2.5-0.5b
summary a_fixed_nofreeze b_fixed_freeze
python3 - "$O" <<'PY'
import json, sys
for f in ("a_fixed_nofreeze", "b_fixed_freeze"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{f}.json"))
        print(f, "gc_s", [round(s.get("gc_s", -1), 4) for s in d["steps"]],
              "outside", [round(s["step_s"] - s["timing_s"]["gen"] - s["timing_s"]["update_actor"], 4) for s in d["steps"]])
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
PY
