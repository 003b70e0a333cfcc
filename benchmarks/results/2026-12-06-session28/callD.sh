#!/usr/bin/env bash
# Session 28, call D: the 3B parts of session 27's callX.sh (spread, then fixed), each JSON with the machine's
# measured GEMM and copy rates. Carry `.whl`; ~5 min.
set -u
O=$OUT/cD; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --shape qwen2.5-3b)
timeout 130 "${B[@]}" --steps 3 --lengths spread --out "$O/spread_3b.json" "${K[@]}" > "$O/spread_3b.log" 2>&1; echo "spread_3b rc=$? $((SECONDS - T0))s"
timeout 170 "${B[@]}" --steps 3 --out "$O/fixed_3b.json" "${K[@]}" > "$O/fixed_3b.log" 2>&1; echo "fixed_3b rc=$? $((SECONDS - T0))s"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("spread_3b", "fixed_3b"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "step_over_roofline_measured_rates", "decode_fraction_of_hbm_floor",
                                                   "decode_fraction_of_hbm_floor_this_gpu", "timing_s")}),
              "step", [round(s["step_s"], 3) for s in d["steps"]],
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "mfu", [round(s["actor_update_mfu"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]])
        for when, m in d.get("machine", {}).items():
            print("  machine", when, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()}))
    except Exception as e:
        print(f, "unreadable", e)
PY
