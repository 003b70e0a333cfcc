#!/usr/bin/env bash
# Next session's first call (prepared in session 20, not run: its three calls all got H100s): session 20's code
# on an H200 as a whole (the issue-16 figures: 0.5B fixed and spread, 3B fixed and spread at the defaults),
# the RMSNorm kernel bench (its call H failed on a bench bug), the sampler bench (the opt-in block skip,
# MEGATRON_RL_SAMPLER_BLOCK_SKIP: turn it on if faster on flat and peaked rows) and one profiled 0.5B step. ~9 min.
set -u
O=$OUT/cI; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > 580 )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --steps 4)
t 100 fixed "${B[@]}" --shape qwen2.5-0.5b --out "$O/fixed.json" "${K[@]}"
t 80 spread "${B[@]}" --shape qwen2.5-0.5b --lengths spread --out "$O/spread.json" "${K[@]}"
t 160 fixed_3b python3 benchmarks/bench_rl_step.py --steps 3 --shape qwen2.5-3b --out "$O/fixed_3b.json" "${K[@]}"
t 120 spread_3b python3 benchmarks/bench_rl_step.py --steps 3 --shape qwen2.5-3b --lengths spread --out "$O/spread_3b.json" "${K[@]}"
t 40 rmsnorm python3 benchmarks/bench_update_kernels.py --cases rmsnorm --out "$O/rmsnorm.json"
t 60 sampler python3 benchmarks/bench_sampler.py --rows 512 --key-sets 4 --out "$O/sampler.json"  # block skip (opt-in) vs the default
t 90 fixed_prof python3 benchmarks/bench_rl_step.py --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" --profile "$O/prof" --profile-update-seqs 64 "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed", "spread", "fixed_3b", "spread_3b"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu", "timing_s")}),
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]],
              "frac", [round(s["decode"]["fraction_of_hbm_floor"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
try:
    for r in json.load(open(f"{O}/rmsnorm.json"))["rmsnorm"]:
        print("rmsnorm", r["hidden"], "torch", r["torch"]["fwd_bwd_us"], "triton", r["triton_backward"]["fwd_bwd_us"], "bwd", r["torch_bwd_us"], r["triton_bwd"][0]["bwd_us"])
except Exception as e:
    print("rmsnorm unreadable", e)
try:
    r = json.load(open(f"{O}/sampler.json"))["results"][0]
    print("sampler", {k: round(v, 1) for k, v in r.items() if k.endswith("_us") and "_s" not in k[6:9]}, {k: v for k, v in r.items() if "mismatch" in k and v})
except Exception as e:
    print("sampler unreadable", e)
PY
tar czf "$OUT/cI.tgz" -C "$OUT" cI
