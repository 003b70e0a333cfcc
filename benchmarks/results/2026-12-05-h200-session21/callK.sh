#!/usr/bin/env bash
# Session 21, call K: the cascade decode attention (kernels.decode_attention._prefix_kernel: one program per
# prompt reads its keys/values once for the samples decoding it; MEGATRON_RL_DECODE_CASCADE=0 off) on top of
# the LM head on response tokens only: the kernel alone (bench_decode_attention, default config), the 0.5B
# fixed step with the cascade on and off (same tree, same card), then the session's tree at 0.5B spread and
# 3B spread / fixed.
set -u
O=$OUT/cK; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > 590 )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
for shape in qwen2.5-0.5b qwen2.5-3b; do
  t 40 attn_$shape python3 benchmarks/bench_decode_attention.py --shape $shape --default-only --out "$O/attn_$shape.json"
done
B=(python3 benchmarks/bench_rl_step.py)
t 90 fixed "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed.json" "${K[@]}"
MEGATRON_RL_DECODE_CASCADE=0 t 90 fixed_nocascade "${B[@]}" --steps 4 --shape qwen2.5-0.5b --out "$O/fixed_nocascade.json" "${K[@]}"
t 80 spread "${B[@]}" --steps 4 --shape qwen2.5-0.5b --lengths spread --out "$O/spread.json" "${K[@]}"
t 100 spread_3b "${B[@]}" --steps 3 --shape qwen2.5-3b --lengths spread --out "$O/spread_3b.json" "${K[@]}"
t 130 fixed_3b "${B[@]}" --steps 2 --shape qwen2.5-3b --out "$O/fixed_3b.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("attn_qwen2.5-0.5b", "attn_qwen2.5-3b"):
    try:
        d = json.load(open(f"{O}/{f}.json")); print(f, json.dumps(d["current_default"]), json.dumps(d["prompt_kv_sharing"]))
    except Exception as e:
        print(f, "unreadable", e)
for f in ("fixed", "fixed_nocascade", "spread", "spread_3b", "fixed_3b"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu", "decode_fraction_of_hbm_floor", "timing_s")}),
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]],
              "lp diff", [round(s["rollout_logprob_abs_diff"], 4) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
PY
tar czf "$OUT/cK.tgz" -C "$OUT" cK
