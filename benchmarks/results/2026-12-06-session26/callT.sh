#!/usr/bin/env bash
# Session 25, second call: the engine's retire without draining the device (MEGATRON_RL_ASYNC_RETIRE=1)
# against the default, 0.5B fixed and spread, in one call; the 3B
# shape on an H200 with the tree as it is (spread and fixed; the last H200 figures are session 18's); then one
# 0.5B fixed step with generation and the update under the profiler: where the 2.8 ms of a 512-row decode
# step and the update's 2 s go. Carry `.whl`; ~8-9 min (SKIP_3B=1: without the 3B parts; ASYNC_ONLY=1: the async
# retire A/B alone, ~4-5 min).
set -u
O=$OUT/cT; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-590} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py)
t 100 fixed_off "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_off.json" --sync-audit "$O/syncs_fixed.json" "${K[@]}"
t 90 fixed_async env MEGATRON_RL_ASYNC_RETIRE=1 "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_async.json" "${K[@]}"
t 80 spread_off "${B[@]}" --steps 4 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_off.json" "${K[@]}"
t 80 spread_async env MEGATRON_RL_ASYNC_RETIRE=1 "${B[@]}" --steps 4 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_async.json" "${K[@]}"
[ -z "${SKIP_3B:-}${ASYNC_ONLY:-}" ] && t 110 spread_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --lengths spread --out "$O/spread_3b.json" "${K[@]}"
[ -z "${SKIP_3B:-}${ASYNC_ONLY:-}" ] && t 150 fixed_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --out "$O/fixed_3b.json" "${K[@]}"
[ -z "${ASYNC_ONLY:-}" ] && t 170 fixed_prof "${B[@]}" --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" --profile "$O/prof_fixed" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_off", "fixed_async", "spread_off", "spread_async", "spread_3b", "fixed_3b", "fixed_prof"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "decode_fraction_of_hbm_floor", "actor_update_mfu", "timing_s")}),
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]],
              "sync host s", [round(s["decode"].get("sync_host_s", -1), 3) for s in d["steps"]],
              "syncs", [s["decode"].get("syncs") for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
try:
    a = json.load(open(f"{O}/syncs_fixed.json"))
    print("syncs_fixed", a["syncs"], {p: v["syncs"] for p, v in a["phases"].items()}, dict(list(a["sites"].items())[:8]))
except Exception as e:
    print("syncs_fixed unreadable", e)
for n in ("generate", "update"):
    try:
        g = json.load(open(f"{O}/prof_fixed/{n}_gaps.json"))
        print(n, "idle us", round(g["idle_us"]), "of", round(g["window_us"]), "by annotation",
              {k: round(v["us"]) for k, v in list(g["by_annotation"].items())[:8]})
    except Exception as e:
        print(n, "gaps unreadable", e)
PY
ls -la "$O/prof_fixed" 2>/dev/null
tar czf "$OUT/cT.tgz" -C "$OUT" cT
