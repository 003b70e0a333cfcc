#!/usr/bin/env bash
# Session 19, call A: the landed code as a whole (session 18's call C was never run), before changing anything.
# Kernel benches with the one-exp online update off and on (MEGATRON_RL_ONE_EXP, working-tree change), the
# Triton RMSNorm backward rows; where a decode step's time goes (profile_decode_step.py: the loop's ms/step
# against the graph replay and the sampler alone); the 0.5B GRPO step, fixed and spread.
set -u
O=$OUT/cA; mkdir -p "$O"
t() { local lim=$1 name=$2; shift 2; timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $(date +%T)"; }
t 100 kernels python3 benchmarks/bench_update_kernels.py --out "$O/update_kernels.json"
MEGATRON_RL_ONE_EXP=1 t 100 kernels_one python3 benchmarks/bench_update_kernels.py --out "$O/update_kernels_one.json"
t 60 sampler python3 benchmarks/bench_sampler.py --out "$O/sampler.json"
MEGATRON_RL_ONE_EXP=1 t 60 sampler_one python3 benchmarks/bench_sampler.py --out "$O/sampler_one.json"
t 120 decode_prof python3 benchmarks/profile_decode_step.py --out "$O/decode_step.json"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
t 100 fixed python3 benchmarks/bench_rl_step.py --steps 3 --out "$O/fixed.json" --shape qwen2.5-0.5b "${K[@]}"
t 100 spread python3 benchmarks/bench_rl_step.py --steps 3 --out "$O/spread.json" --shape qwen2.5-0.5b --lengths spread "${K[@]}"
python3 - "$O" <<'PY'
import json, sys, glob
O = sys.argv[1]
for f in ("fixed", "spread"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
        print(f, json.dumps({k: r[k] for k in ("step_s", "step_over_roofline", "actor_update_mfu_as_run", "timing_s")}),
              json.dumps({k: last.get(k) for k in ("ms_per_decode_step", "fraction_of_hbm_floor", "capture_s")}))
    except Exception as e:
        print(f, "unreadable", e)
for f in ("update_kernels", "update_kernels_one", "sampler", "sampler_one"):
    try:
        print(f, json.dumps(json.load(open(f"{O}/{f}.json")))[:900])
    except Exception as e:
        print(f, "unreadable", e)
try:
    d = json.load(open(f"{O}/decode_step.json")); print({k: v for k, v in d.items() if k != "config"})
except Exception as e:
    print("decode_step unreadable", e)
PY
tar czf "$OUT/cA.tgz" -C "$OUT" cA
