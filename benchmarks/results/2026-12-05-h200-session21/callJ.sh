#!/usr/bin/env bash
# Session 21, call J: the LM head on response tokens only (models.pipeline.ResponseLogits; micro-batches
# bounded by response tokens) and the sampler's block skip on by default, against the tree before them
# (commit 7b73fe7 from .carry/old.tgz, unpacked in /tmp/old), in one call on one card: 0.5B spread (whole
# update profiled, both trees), 0.5B fixed (no padding: should not move), 3B spread.
set -u
O=$OUT/cJ; mkdir -p "$O"; T0=$SECONDS
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .carry/old.tgz -C /tmp/old
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() {  # limit, name, tree, extra args
  local lim=$1 name=$2 tree=$3; shift 3
  if (( SECONDS - T0 + lim > 590 )); then echo "$name skipped (time)"; return; fi
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$lim" python3 benchmarks/bench_rl_step.py \
    --out "$O/$name.json" "$@" "${K[@]}" > "$O/$name.log" 2>&1); echo "$name rc=$? $((SECONDS - T0))s"
}
run 100 spread_new "$PWD" --steps 4 --shape qwen2.5-0.5b --lengths spread --profile "$O/prof_spread_new"
run 100 spread_old /tmp/old --steps 4 --shape qwen2.5-0.5b --lengths spread --profile "$O/prof_spread_old"
run 90 fixed_new "$PWD" --steps 4 --shape qwen2.5-0.5b
run 90 fixed_old /tmp/old --steps 4 --shape qwen2.5-0.5b
run 100 spread_3b_new "$PWD" --steps 3 --shape qwen2.5-3b --lengths spread
run 100 spread_3b_old /tmp/old --steps 3 --shape qwen2.5-3b --lengths spread
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("spread_new", "spread_old", "fixed_new", "fixed_old", "spread_3b_new", "spread_3b_old"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu", "timing_s")}),
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
PY
tar czf "$OUT/cJ.tgz" -C "$OUT" cJ
