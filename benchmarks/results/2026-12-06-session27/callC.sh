#!/usr/bin/env bash
# Session 27, call C: the decode step's rows as two ranges on two CUDA streams (MEGATRON_RL_DECODE_SPLIT=2:
# one range's GEMMs beside the other's attention) and the decode-attention tile 64 / 2 warps / 2 stages
# (MEGATRON_RL_DECODE_ATTENTION_TILE, call A's equal-position sweep), on the 0.5B fixed workload (decode ms a
# step, the step against the roofline), the spread pair, then the GPU check of the split graphs (graph replays
# equal eager steps; graph engine equals eager engine). Carry `.whl`; ~9 min.
set -u
O=$OUT/cC; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-560} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b)
S2=(env MEGATRON_RL_DECODE_SPLIT=2)
T2=(env MEGATRON_RL_DECODE_ATTENTION_TILE=64,2,2)
t 40 check_split env MEGATRON_RL_DECODE_SPLIT=2 MEGATRON_RL_DECODE_SPLIT_FROM_ROWS=16 \
  python3 benchmarks/check_decode_graphs.py --dtype bfloat16 --out "$O/check_split.json"
t 80 fixed_base "${B[@]}" --steps 3 --out "$O/fixed_base.json" "${K[@]}"
t 80 fixed_split "${S2[@]}" "${B[@]}" --steps 3 --out "$O/fixed_split.json" "${K[@]}"
t 80 fixed_tile "${T2[@]}" "${B[@]}" --steps 3 --out "$O/fixed_tile.json" "${K[@]}"
t 80 fixed_split_tile "${S2[@]}" MEGATRON_RL_DECODE_ATTENTION_TILE=64,2,2 "${B[@]}" --steps 3 --out "$O/fixed_split_tile.json" "${K[@]}"
t 60 spread_base "${B[@]}" --steps 4 --lengths spread --out "$O/spread_base.json" "${K[@]}"
t 60 spread_split "${S2[@]}" "${B[@]}" --steps 4 --lengths spread --out "$O/spread_split.json" "${K[@]}"
t 80 fixed_base2 "${B[@]}" --steps 3 --out "$O/fixed_base2.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_base", "fixed_split", "fixed_tile", "fixed_split_tile", "spread_base", "spread_split", "fixed_base2"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "decode_fraction_of_hbm_floor", "decode_fraction_of_hbm_floor_this_gpu")}),
              "step", [round(s["step_s"], 3) for s in d["steps"]],
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]],
              "lp diff", [round(s["rollout_logprob_abs_diff"], 4) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
try:
    print("check_split", json.dumps(json.load(open(f"{O}/check_split.json")))[:1500])
except Exception as e:
    print("check_split unreadable", e)
PY
tail -3 "$O/check_split.log"
tar czf "$OUT/cC.tgz" -C "$OUT" cC
