#!/usr/bin/env bash
# Session 19, call B: the decode kernel that runs each shared prompt once per group of samples
# (MEGATRON_RL_DECODE_PROMPT_ONCE, new default) against the one-pass kernel (=0), alone and in the 0.5B GRPO
# step (fixed and spread, both settings in this call); the update's kernel bench (RMSNorm and SwiGLU Triton
# backwards against torch's / the compiled ones); the 0.5B step with the Triton RMSNorm backward on if time is left.
set -u
O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > 570 )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
t 60 attn_05b python3 benchmarks/bench_decode_attention.py --default-only --shape qwen2.5-0.5b --out "$O/attn_05b.json"
t 60 attn_3b python3 benchmarks/bench_decode_attention.py --default-only --shape qwen2.5-3b --out "$O/attn_3b.json"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --steps 3 --shape qwen2.5-0.5b)
MEGATRON_RL_DECODE_PROMPT_ONCE=0 t 90 fixed_off "${B[@]}" --out "$O/fixed_off.json" "${K[@]}"
t 90 fixed_on "${B[@]}" --out "$O/fixed_on.json" "${K[@]}"
MEGATRON_RL_DECODE_PROMPT_ONCE=0 t 80 spread_off "${B[@]}" --lengths spread --out "$O/spread_off.json" "${K[@]}"
t 80 spread_on "${B[@]}" --lengths spread --out "$O/spread_on.json" "${K[@]}"
t 100 kernels python3 benchmarks/bench_update_kernels.py --out "$O/update_kernels.json"
MEGATRON_RL_TRITON_RMSNORM=1 t 90 fixed_on_rms "${B[@]}" --out "$O/fixed_on_rms.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys, glob
O = sys.argv[1]
for f in ("fixed_off", "fixed_on", "spread_off", "spread_on", "fixed_on_rms"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu", "decode_fraction_of_hbm_floor_this_gpu", "timing_s")}),
              json.dumps({k: last.get(k) for k in ("ms_per_decode_step", "fraction_of_hbm_floor", "capture_s")}))
    except Exception as e:
        print(f, "unreadable", e)
for f in ("attn_05b", "attn_3b"):
    try:
        d = json.load(open(f"{O}/{f}.json")); print(f, json.dumps(d["current_default"]), json.dumps(d["prompt_kv_sharing"]))
    except Exception as e:
        print(f, "unreadable", e)
try:
    d = json.load(open(f"{O}/update_kernels.json"))
    for k in ("logprob", "rmsnorm", "swiglu"):
        for row in d.get(k, []):
            print(k, json.dumps(row)[:600])
except Exception as e:
    print("update_kernels unreadable", e)
PY
tar czf "$OUT/cB.tgz" -C "$OUT" cB
