#!/usr/bin/env bash
# Session 20, call H: the Triton RMSNorm backward after call G (its forward now torch's fused op with the saved
# 1/rms, the sweep's blocks as defaults): the kernel bench, then the 0.5B fixed step with it off and on.
set -u
O=$OUT/cH; mkdir -p "$O"; T0=$SECONDS
timeout 60 python3 benchmarks/bench_update_kernels.py --cases rmsnorm --out "$O/rmsnorm.json" > "$O/rmsnorm.log" 2>&1
echo "rmsnorm rc=$? $((SECONDS - T0))s"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
for on in 1 0; do
  MEGATRON_RL_TRITON_RMSNORM=$on timeout 90 python3 benchmarks/bench_rl_step.py --steps 4 --shape qwen2.5-0.5b \
    --out "$O/fixed_rms$on.json" "${K[@]}" > "$O/fixed_rms$on.log" 2>&1; echo "fixed_rms$on rc=$? $((SECONDS - T0))s"
done
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
try:
    for r in json.load(open(f"{O}/rmsnorm.json"))["rmsnorm"]:
        print("rmsnorm", r["hidden"], "torch fwd+bwd", r["torch"]["fwd_bwd_us"], "triton fwd+bwd", r["triton_backward"]["fwd_bwd_us"],
              r["triton_backward"]["max_abs_diff"], "torch bwd", r["torch_bwd_us"], "triton bwd", [(b["tile"], b["num_warps"], b["programs"], b["bwd_us"]) for b in r["triton_bwd"]])
except Exception as e:
    print("rmsnorm unreadable", e)
for on in (0, 1):
    try:
        d = json.load(open(f"{O}/fixed_rms{on}.json")); r = d["median_after_warmup"]
        print(f"fixed_rms{on}", json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu", "timing_s")}))
        print("   update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]], "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]])
    except Exception as e:
        print(on, "unreadable", e)
PY
grep -h -i "failed its trial" "$O"/*.log | sort | uniq -c | head -4
tar czf "$OUT/cH.tgz" -C "$OUT" cH
