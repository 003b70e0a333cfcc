#!/usr/bin/env bash
# Next session's first call (not run in session 19: the device time was spent): the update's kernels again
# (the Triton RMSNorm backward now loads rows in tiles), one profiled 0.5B fixed step (op tables by input shape:
# which tensors the update's copies and elementwise kernels move), 3B fixed and spread at the current defaults
# (the SwiGLU kernel on; 3B fixed was 15.44 s = 1.295x in session 18). ~9 min on an H200.
set -u
O=$OUT/cD; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > 580 )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --steps 3)
t 100 kernels python3 benchmarks/bench_update_kernels.py --out "$O/update_kernels.json"
t 170 fixed_prof "${B[@]}" --shape qwen2.5-0.5b --out "$O/fixed_prof.json" --profile "$O/prof" --profile-update-seqs 64 "${K[@]}"
t 150 fixed_3b "${B[@]}" --shape qwen2.5-3b --out "$O/fixed_3b.json" "${K[@]}"
t 120 spread_3b "${B[@]}" --shape qwen2.5-3b --lengths spread --out "$O/spread_3b.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_prof", "fixed_3b", "spread_3b"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu", "timing_s")}),
              json.dumps({k: last.get(k) for k in ("ms_per_decode_step", "fraction_of_hbm_floor")}))
    except Exception as e:
        print(f, "unreadable", e)
try:
    d = json.load(open(f"{O}/update_kernels.json"))
    for k in ("rmsnorm", "swiglu"):
        for row in d.get(k, []):
            print(k, json.dumps({n: v for n, v in row.items() if n != "triton_blocks"})[:500])
except Exception as e:
    print("update_kernels unreadable", e)
PY
head -n 45 "$O/prof/update_ops_by_shape.txt" | cut -c1-60,100-130,150-330
tar czf "$OUT/cD.tgz" -C "$OUT" cD
