#!/usr/bin/env bash
# Next session's third call: the decode step with RoPE and the KV write inside the attention kernel
# (MEGATRON_RL_DECODE_ROPE_IN_ATTENTION=1, written after session 19's device time was spent: one launch per
# layer fewer, the same bits on the CPU) off and on in one call, 0.5B fixed and spread, 5 steps each.
set -u
O=$OUT/cF; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > 580 )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --steps 5 --shape qwen2.5-0.5b)
MEGATRON_RL_DECODE_ROPE_IN_ATTENTION=1 t 130 fixed_on "${B[@]}" --out "$O/fixed_on.json" "${K[@]}"
t 130 fixed_off "${B[@]}" --out "$O/fixed_off.json" "${K[@]}"
MEGATRON_RL_DECODE_ROPE_IN_ATTENTION=1 t 100 spread_on "${B[@]}" --lengths spread --out "$O/spread_on.json" "${K[@]}"
t 100 spread_off "${B[@]}" --lengths spread --out "$O/spread_off.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_off", "fixed_on", "spread_off", "spread_on"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]], [round(s["step_s"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
PY
grep -h "RoPE inside failed" "$O"/*.log | head -2
tar czf "$OUT/cF.tgz" -C "$OUT" cF
