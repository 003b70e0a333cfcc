#!/usr/bin/env bash
# Session 17, call C: the rollout engine empties the caching allocator before generation only when the KV
# cache does not fit the driver's free memory (was: every step). The GRPO step on the fixed workload with the
# code before (HEAD's engine.py and kv_cache.py from .carry/old.tgz, in a copy of the tree) and after, in this
# one call, at 0.5B and 3B; the 0.5B spread workload after.
set -u
O=$OUT/cC; mkdir -p "$O"
rm -rf /tmp/old && cp -r "$PWD" /tmp/old && tar xzf .carry/old.tgz -C /tmp/old
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() {  # name, tree, extra args
  local name=$1 tree=$2; shift 2
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 170 python3 benchmarks/bench_rl_step.py --steps 3 \
    --out "$O/$name.json" "${K[@]}" "$@" > "$O/$name.log" 2>&1); echo "$name rc=$?"
  grep -v -i warn "$O/$name.log" | tail -n 2 | cut -c1-400
}
run fixed_before /tmp/old --shape qwen2.5-0.5b
run fixed_after "$PWD" --shape qwen2.5-0.5b
run spread_after "$PWD" --shape qwen2.5-0.5b --lengths spread
run fixed_3b_after "$PWD" --shape qwen2.5-3b
run fixed_3b_before /tmp/old --shape qwen2.5-3b
python3 - "$O" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*_*.json")):
    if "attn" in f:
        continue
    try:
        d = json.load(open(f)); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
    except Exception as e:
        print(f, "unreadable", e); continue
    print(f.split("/")[-1], json.dumps(r), json.dumps({k: last.get(k) for k in
          ("ms_per_decode_step", "fraction_of_hbm_floor", "mean_rows_per_step", "slots", "decode_s", "prefill_s", "reshard_s")}))
PY
tar czf "$OUT/cC.tgz" -C "$OUT" cC
