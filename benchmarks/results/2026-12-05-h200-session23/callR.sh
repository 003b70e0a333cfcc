#!/usr/bin/env bash
# Next session's first call (prepared in session 23, which had no device; session 22's callQ.sh plus the sync
# audit): this tree as a whole, on an H200 if one comes (every call of sessions 20-22 got an H100): 0.5B fixed and spread, 3B spread and fixed at the
# defaults, then one 0.5B spread step with its whole update and generation under the profiler (with
# {generate,update}_gaps.json: the device's idle gaps by host phase). First, the GPU check of the shared
# logits buffer and the finer buckets (check_decode_graphs.py, ~30 s; its "problems" list must be empty). The decode
# stats now carry `syncs` / `sync_host_s` (host time the device idles through at each sync). ~7-8 min on an
# H100 (call L's parts took 361 s); carry `.whl`. The fixed and spread parts each run one more step under
# benchmarks/sync_audit.py (the synchronizing CUDA calls counted by the project line that made them):
# syncs_{fixed,spread}.json.
set -u
O=$OUT/cR; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > 585 )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py)
t 90 check_graphs python3 benchmarks/check_decode_graphs.py --out "$O/check_decode_graphs.json"  # exits 1 on a problem
t 110 fixed "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed.json" --sync-audit "$O/syncs_fixed.json" "${K[@]}"
t 90 spread "${B[@]}" --steps 4 --shape qwen2.5-0.5b --lengths spread --out "$O/spread.json" --sync-audit "$O/syncs_spread.json" "${K[@]}"
t 100 spread_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --lengths spread --out "$O/spread_3b.json" "${K[@]}"
t 140 fixed_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --out "$O/fixed_3b.json" "${K[@]}"
t 170 spread_prof "${B[@]}" --steps 2 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_prof.json" --profile "$O/prof_spread" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
try:
    print("check_graphs problems:", json.load(open(f"{O}/check_decode_graphs.json"))["problems"])
except Exception as e:
    print("check_graphs unreadable", e)
for f in ("fixed", "spread", "spread_3b", "fixed_3b", "spread_prof"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "decode_fraction_of_hbm_floor", "timing_s")}),
              "sync host s", [round(s["decode"].get("sync_host_s", -1), 3) for s in d["steps"]],
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
for f in ("syncs_fixed", "syncs_spread"):
    try:
        a = json.load(open(f"{O}/{f}.json"))
        print(f, a["syncs"], "syncs;", {p: v["syncs"] for p, v in a["phases"].items()}, "top sites",
              dict(list(a["sites"].items())[:12]))
    except Exception as e:
        print(f, "unreadable", e)
for n in ("generate", "update"):
    try:
        g = json.load(open(f"{O}/prof_spread/{n}_gaps.json"))
        print(n, "idle us", round(g["idle_us"]), "of", round(g["window_us"]), "by annotation",
              {k: round(v["us"]) for k, v in list(g["by_annotation"].items())[:8]})
    except Exception as e:
        print(n, "gaps unreadable", e)
PY
tar czf "$OUT/cR.tgz" -C "$OUT" cR
