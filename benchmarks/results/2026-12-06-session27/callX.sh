#!/usr/bin/env bash
# For session 28: issue 16's targets at session 27's tree on the GPU the call gets (they name an H200; since
# session 25 only H100s came): 0.5B fixed and spread, 3B spread and fixed, each JSON with the machine's measured
# GEMM and copy rates (`machine`) and the step against the roofline at them; then the profiled 0.5B fixed step.
# Carry `.whl`; ~8 min (SKIP_3B=1: ~4 min).
set -u
O=$OUT/cX; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-580} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py)
t 115 fixed "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed.json" "${K[@]}"
t 85 spread "${B[@]}" --steps 5 --shape qwen2.5-0.5b --lengths spread --out "$O/spread.json" "${K[@]}"
[ -z "${SKIP_3B:-}" ] && t 115 spread_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --lengths spread --out "$O/spread_3b.json" "${K[@]}"
[ -z "${SKIP_3B:-}" ] && t 155 fixed_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --out "$O/fixed_3b.json" "${K[@]}"
t 120 fixed_prof "${B[@]}" --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" --profile "$O/prof_fixed" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed", "spread", "spread_3b", "fixed_3b", "fixed_prof"):
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
for n in ("generate", "update"):
    try:
        g = json.load(open(f"{O}/prof_fixed/{n}_gaps.json"))
        print(n, "idle us", round(g["idle_us"]), "of", round(g["window_us"]), "by annotation",
              {k: round(v["us"]) for k, v in list(g["by_annotation"].items())[:8]})
    except Exception as e:
        print(n, "gaps unreadable", e)
PY
tar czf "$OUT/cX.tgz" -C "$OUT" cX
