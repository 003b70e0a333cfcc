#!/usr/bin/env bash
# Session 20, call G: this session's three changes measured against the tree before them (commit 4d9cb09 from
# .carry/old.tgz, unpacked in /tmp/old), all in one call on one card:
# - the sampler's noise filter (kernels/sampler.py; MEGATRON_RL_SAMPLER_FILTER=0 off): bench_sampler at 512 rows,
# - GQA keys/values straight into flash attention in the update (MEGATRON_RL_FLASH_GQA=0 off),
# - RoPE's backward as its own one-kernel compiled rotation (no switch: old tree vs new),
# then two opt-ins on the new tree: session 19's RoPE inside the decode attention kernel (its call F) and the
# Triton RMSNorm backward (a warp per row now; its tile / warps / programs swept in bench_update_kernels).
set -u
O=$OUT/cG; mkdir -p "$O"; T0=$SECONDS
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .carry/old.tgz -C /tmp/old
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() {  # limit, name, tree, extra args
  local lim=$1 name=$2 tree=$3; shift 3
  if (( SECONDS - T0 + lim > 585 )); then echo "$name skipped (time)"; return; fi
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$lim" python3 benchmarks/bench_rl_step.py --steps 4 \
    --shape qwen2.5-0.5b --out "$O/$name.json" "$@" "${K[@]}" > "$O/$name.log" 2>&1); echo "$name rc=$? $((SECONDS - T0))s"
}
timeout 80 python3 benchmarks/bench_sampler.py --rows 512 --key-sets 4 --out "$O/sampler.json" > "$O/sampler.log" 2>&1
echo "sampler rc=$? $((SECONDS - T0))s"
timeout 60 python3 benchmarks/bench_update_kernels.py --cases rmsnorm --out "$O/rmsnorm.json" > "$O/rmsnorm.log" 2>&1
echo "rmsnorm rc=$? $((SECONDS - T0))s"
run 100 fixed_new "$PWD"
run 100 fixed_old /tmp/old
run 80 spread_new "$PWD" --lengths spread
run 80 spread_old /tmp/old --lengths spread
MEGATRON_RL_SAMPLER_FILTER=0 MEGATRON_RL_FLASH_GQA=0 run 100 fixed_new_filter_gqa_off "$PWD"
MEGATRON_RL_TRITON_RMSNORM=1 run 100 fixed_new_rmsnorm "$PWD"
MEGATRON_RL_DECODE_ROPE_IN_ATTENTION=1 run 100 fixed_new_rope_in_attn "$PWD"
python3 - "$O" <<'PY'
import json, sys, glob
O = sys.argv[1]
try:
    for r in json.load(open(f"{O}/sampler.json"))["results"]:
        print("sampler", json.dumps({k: v for k, v in r.items() if "triton" in k and ("_s" not in k or "unfiltered" in k) or k == "read_logits_us"}))
except Exception as e:
    print("sampler unreadable", e)
try:
    for r in json.load(open(f"{O}/rmsnorm.json"))["rmsnorm"]:
        print("rmsnorm", r["hidden"], "torch fwd+bwd", r["torch"]["fwd_bwd_us"], "triton fwd+bwd", r["triton_backward"]["fwd_bwd_us"],
              "torch bwd", r["torch_bwd_us"], "triton bwd", [(b["tile"], b["num_warps"], b["programs"], b["bwd_us"]) for b in r["triton_bwd"]])
except Exception as e:
    print("rmsnorm unreadable", e)
for f in sorted(glob.glob(O + "/*_*.json")):
    try:
        d = json.load(open(f)); r = d["median_after_warmup"]
        print(f.split("/")[-1][:-5], json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu", "timing_s")}))
        print("   update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]], "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
PY
grep -h -i "varlen\|GQA\|failed its trial\|RoPE inside failed" "$O"/*.log | sort | uniq -c | head -8
tar czf "$OUT/cG.tgz" -C "$OUT" cG
