#!/usr/bin/env bash
# Session 19, call C: the 0.5B GRPO step, fixed and spread, with this session's two defaults off (MEGATRON_RL_DECODE_PROMPT_ONCE=0
# MEGATRON_RL_TRITON_SWIGLU=0: the tree as it was) and on, in this call; nothing else: five starts failed
# before this call (~13 min of the session's device time), so the kernel bench and 3B did not fit.
set -u
O=$OUT/cC; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > 335 )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --steps 3)
OFF=(env MEGATRON_RL_DECODE_PROMPT_ONCE=0 MEGATRON_RL_TRITON_SWIGLU=0)
t 90 fixed_on "${B[@]}" --shape qwen2.5-0.5b --out "$O/fixed_on.json" "${K[@]}"
t 90 fixed_off "${OFF[@]}" "${B[@]}" --shape qwen2.5-0.5b --out "$O/fixed_off.json" "${K[@]}"
t 75 spread_on "${B[@]}" --shape qwen2.5-0.5b --lengths spread --out "$O/spread_on.json" "${K[@]}"
t 75 spread_off "${OFF[@]}" "${B[@]}" --shape qwen2.5-0.5b --lengths spread --out "$O/spread_off.json" "${K[@]}"
t 150 fixed_3b_on "${B[@]}" --shape qwen2.5-3b --out "$O/fixed_3b_on.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_off", "fixed_on", "spread_off", "spread_on", "fixed_3b_on", "spread_3b_on"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu", "decode_fraction_of_hbm_floor_this_gpu", "timing_s")}),
              json.dumps({k: last.get(k) for k in ("ms_per_decode_step", "fraction_of_hbm_floor", "capture_s")}))
    except Exception as e:
        print(f, "unreadable", e)
try:
    d = json.load(open(f"{O}/attn_05b.json")); print("attn_05b", json.dumps(d["current_default"]), json.dumps(d["prompt_kv_sharing"]))
except Exception as e:
    print("attn_05b unreadable", e)
PY
tar czf "$OUT/cC.tgz" -C "$OUT" cC
