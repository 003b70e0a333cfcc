#!/usr/bin/env bash
# Session 26, second call: reward.overlap (scoring and the advantage estimate inside the update's first loss, its
# forward queued) against scoring before the update, 0.5B fixed and spread lengths, in one call (the async
# retire on in both: the default since call T); the sampler at other software-pipelining depths of its vocab loop
# (is it latency-bound?); then the profiled 0.5B fixed step (where the device still idles). Carry `.whl`; ~6-7 min.
set -u
O=$OUT/cU; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-590} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py)
t 100 fixed_on "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_on.json" "${K[@]}"
t 90 fixed_off "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_off.json" "${K[@]}" reward.overlap=false
t 80 spread_on "${B[@]}" --steps 4 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_on.json" "${K[@]}"
t 80 spread_off "${B[@]}" --steps 4 --shape qwen2.5-0.5b --lengths spread --out "$O/spread_off.json" "${K[@]}" reward.overlap=false
t 150 sampler python3 benchmarks/bench_sampler.py --rows 256,512 --key-sets 4 --out "$O/sampler.json"
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
tar czf "$OUT/cU.tgz" -C "$OUT" cU
