#!/usr/bin/env bash
# Session 25, the short form of callT.sh for little device time: only the async retire A/B
# (MEGATRON_RL_ASYNC_RETIRE=1 against the default), 0.5B fixed and spread, 4 steps each, in one call. ~4-5 min.
set -u
O=$OUT/cU; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-590} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --steps 4)
t 90 fixed_off "${B[@]}" --out "$O/fixed_off.json" "${K[@]}"
t 80 fixed_async env MEGATRON_RL_ASYNC_RETIRE=1 "${B[@]}" --out "$O/fixed_async.json" "${K[@]}"
t 70 spread_off "${B[@]}" --lengths spread --out "$O/spread_off.json" "${K[@]}"
t 70 spread_async env MEGATRON_RL_ASYNC_RETIRE=1 "${B[@]}" --lengths spread --out "$O/spread_async.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_off", "fixed_async", "spread_off", "spread_async"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "decode_fraction_of_hbm_floor", "timing_s")}),
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]],
              "syncs", [s["decode"].get("syncs") for s in d["steps"]],
              "async", [s["decode"].get("async_retires") for s in d["steps"]],
              "sync host s", [round(s["decode"].get("sync_host_s", -1), 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
PY
tar czf "$OUT/cU.tgz" -C "$OUT" cU
