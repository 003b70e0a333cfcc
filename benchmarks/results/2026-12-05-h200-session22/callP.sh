#!/usr/bin/env bash
# Session 22, call P: finer decode batch buckets (multiples of 32 above 32 where the graphs are kept), one
# shared logits buffer for every decode graph, and the Triton sampler at every row count, against the tree
# before them (commit bd92e22 from .carry/old.tgz, unpacked in /tmp/old), in one call on one card:
# 0.5B spread (new, old), 0.5B fixed (new, old), 3B spread new if the time is left.
set -u
O=$OUT/cP; mkdir -p "$O"; T0=$SECONDS
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .carry/old.tgz -C /tmp/old
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() {  # limit, name, tree, extra args
  local lim=$1 name=$2 tree=$3; shift 3
  if (( SECONDS - T0 + lim > ${BUDGET:-430} )); then echo "$name skipped (time)"; return; fi
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$lim" python3 benchmarks/bench_rl_step.py \
    --out "$O/$name.json" "$@" "${K[@]}" > "$O/$name.log" 2>&1); echo "$name rc=$? $((SECONDS - T0))s"
}
run 90 spread_new "$PWD" --steps 4 --shape qwen2.5-0.5b --lengths spread
run 80 spread_old /tmp/old --steps 4 --shape qwen2.5-0.5b --lengths spread
run 90 fixed_new "$PWD" --steps 4 --shape qwen2.5-0.5b
run 90 fixed_old /tmp/old --steps 4 --shape qwen2.5-0.5b
run 90 spread_3b_new "$PWD" --steps 3 --shape qwen2.5-3b --lengths spread
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("spread_new", "spread_old", "fixed_new", "fixed_old", "spread_3b_new"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "decode_fraction_of_hbm_floor", "timing_s")}),
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]],
              "rows", [round(s["decode"]["mean_rows_per_step"], 1) for s in d["steps"]],
              "capture", [round(s["decode"]["capture_s"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
PY
