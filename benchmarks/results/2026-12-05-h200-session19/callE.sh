#!/usr/bin/env bash
# Next session's second call: the Triton SwiGLU backward in the step, off and on in one call, 5 steps each (4
# timed: session 19's two timed steps could not resolve its ~35 ms against the update's step-to-step spread).
set -u
O=$OUT/cE; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > 580 )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --steps 5 --shape qwen2.5-0.5b)
t 130 fixed_on "${B[@]}" --out "$O/fixed_on.json" "${K[@]}"
MEGATRON_RL_TRITON_SWIGLU=0 t 130 fixed_off "${B[@]}" --out "$O/fixed_off.json" "${K[@]}"
t 100 spread_on "${B[@]}" --lengths spread --out "$O/spread_on.json" "${K[@]}"
MEGATRON_RL_TRITON_SWIGLU=0 t 100 spread_off "${B[@]}" --lengths spread --out "$O/spread_off.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_off", "fixed_on", "spread_off", "spread_on"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]], [round(s["step_s"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
PY
tar czf "$OUT/cE.tgz" -C "$OUT" cE
