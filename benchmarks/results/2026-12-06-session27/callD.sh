#!/usr/bin/env bash
# Session 27, call D: bench_rl_step's new machine rates (sustained bf16 GEMM TFLOP/s, device copy TB/s, SM clock
# and power before and after the steps) on the GPU the call gets, with the 0.5B fixed step at the defaults and
# with TORCH_BLAS_PREFER_CUBLASLT=1 (cuBLASLt's kernel choice for every GEMM: the decode step's GEMMs fill
# 28-36 of 132 SMs under cuBLAS's), then the 3B fixed step. Carry `.whl`; ~4.5 min.
set -u
O=$OUT/cD; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-280} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py)
t 90 fixed_base "${B[@]}" --steps 3 --shape qwen2.5-0.5b --out "$O/fixed_base.json" "${K[@]}"
t 90 fixed_lt env TORCH_BLAS_PREFER_CUBLASLT=1 "${B[@]}" --steps 3 --shape qwen2.5-0.5b --out "$O/fixed_lt.json" "${K[@]}"
t 95 fixed_3b "${B[@]}" --steps 2 --shape qwen2.5-3b --out "$O/fixed_3b.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_base", "fixed_lt", "fixed_3b"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "decode_fraction_of_hbm_floor", "decode_fraction_of_hbm_floor_this_gpu")}),
              "step", [round(s["step_s"], 3) for s in d["steps"]],
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "mfu", [round(s["actor_update_mfu"], 3) for s in d["steps"]],
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]])
        for when, m in d.get("machine", {}).items():
            print("  machine", when, json.dumps({k: round(v, 3) for k, v in m.items()} if "error" not in m else m))
    except Exception as e:
        print(f, "unreadable", e)
PY
tar czf "$OUT/cD.tgz" -C "$OUT" cD
