#!/usr/bin/env bash
# Session 26, third call: reward.overlap again after call U showed the device idle through the overlapped
# scoring (74 ms: reading the responses off the device waited for the queued forward; they are now copied to
# pinned memory before the update); 0.5B fixed and spread, overlap on and off in one call; the sampler's
# block 1024 / 4 warps against its default (2048 / 8) on flat and peaked rows; then, if time is left, the
# profiled fixed step. Carry `.whl`; ~7-8 min on call U's machine.
set -u
O=$OUT/cV; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-590} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py)
t 110 fixed_on "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_on.json" "${K[@]}"
t 110 fixed_off "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_off.json" "${K[@]}" reward.overlap=false
t 90 sampler python3 benchmarks/bench_sampler.py --rows 512 --key-sets 2 --out "$O/sampler.json"
t 80 spread_on "${B[@]}" --steps 3 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_on.json" "${K[@]}"
t 80 spread_off "${B[@]}" --steps 3 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_off.json" "${K[@]}" reward.overlap=false
[ -z "${NO_PROF:-}" ] && t 170 fixed_prof "${B[@]}" --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" --profile "$O/prof_fixed" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_on", "fixed_off", "spread_on", "spread_off", "fixed_prof"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "decode_fraction_of_hbm_floor", "timing_s")}),
              "step", [round(s["step_s"], 3) for s in d["steps"]],
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]],
              "reward", [round(s["timing_s"].get("reward", -1), 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
try:
    for r in json.load(open(f"{O}/sampler.json"))["results"]:
        print("sampler", r["rows"], {k[:-3]: round(v, 1) for k, v in r.items() if k.endswith("_us") and "block_skip" in k},
              "b1024_w4", {k[:-3]: round(v, 1) for k, v in r.items() if k.endswith("_us") and "b1024_w4" in k},
              "mismatches", sum(v for k, v in r.items() if k.endswith("token_mismatches") and "block_skip" in k))
except Exception as e:
    print("sampler unreadable", e)
for n in ("generate", "update"):
    try:
        g = json.load(open(f"{O}/prof_fixed/{n}_gaps.json"))
        print(n, "idle us", round(g["idle_us"]), "of", round(g["window_us"]), "by annotation",
              {k: round(v["us"]) for k, v in list(g["by_annotation"].items())[:8]},
              "top", [(round(x["us"]), x["annotation"]) for x in g["top"][:6]])
    except Exception as e:
        print(n, "gaps unreadable", e)
PY
tar czf "$OUT/cV.tgz" -C "$OUT" cV
