#!/usr/bin/env bash
# Session 27, call A: session 26's callX (issue 16's targets with async retire, reward.overlap and the sampler's
# tile from 256 rows, all on by default) on the GPU the call gets (the targets name an H200; compare only within
# the call): 0.5B fixed and spread, overlap on and off in each (spread was inconclusive on session 26's noisy
# machine: 4 timed steps here; the sampler tile runs in both, its own A/B is bench_sampler's), 3B fixed and
# spread, then the profiled 0.5B fixed step. Carry `.whl`; ~9 min (SKIP_3B=1: ~6 min).
set -u
O=$OUT/cA; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-590} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py)
# decode attention with every row at one position (positions 40-543 of a 544-position cache; the fixed
# workload's rows sit at 256-767: prompt 256 + 512 response tokens)
t 60 attn_equal python3 benchmarks/bench_decode_attention.py --shape qwen2.5-0.5b --cache 544 \
  --equal-positions 40,96,160,288,416,543 --out "$O/attn_equal.json"
t 110 fixed_on "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_on.json" "${K[@]}"
t 100 fixed_off "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_off.json" "${K[@]}" reward.overlap=false
t 80 spread_on "${B[@]}" --steps 5 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_on.json" "${K[@]}"
t 80 spread_off "${B[@]}" --steps 5 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_off.json" "${K[@]}" reward.overlap=false
[ -z "${SKIP_3B:-}" ] && t 110 spread_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --lengths spread --out "$O/spread_3b.json" "${K[@]}"
[ -z "${SKIP_3B:-}" ] && t 150 fixed_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --out "$O/fixed_3b.json" "${K[@]}"
t 120 fixed_prof "${B[@]}" --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" --profile "$O/prof_fixed" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_on", "fixed_off", "spread_on", "spread_off", "spread_3b", "fixed_3b", "fixed_prof"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "decode_fraction_of_hbm_floor", "decode_fraction_of_hbm_floor_this_gpu",
                                                   "timing_s")}),
              "step", [round(s["step_s"], 3) for s in d["steps"]],
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]])
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
tar czf "$OUT/cA.tgz" -C "$OUT" cA
