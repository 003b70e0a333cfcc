#!/usr/bin/env bash
# Session 17, call E: call C's change plus the decode graphs captured with capture_begin/capture_end (no
# allocator emptying by torch.cuda.graph); before (HEAD's engine.py, kv_cache.py) and after in one call, at the
# defaults (keep_cache off), 0.5B fixed; then the spread workload after.
set -u
O=$OUT/cE; mkdir -p "$O"
rm -rf /tmp/old && cp -r "$PWD" /tmp/old && tar xzf .carry/old.tgz -C /tmp/old
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() {  # name, tree, extra args
  local name=$1 tree=$2; shift 2
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 115 python3 benchmarks/bench_rl_step.py --steps 3 \
    --out "$O/$name.json" "$@" "${K[@]}" > "$O/$name.log" 2>&1); echo "$name rc=$?"
  grep -v -i warn "$O/$name.log" | tail -n 2 | cut -c1-400
}
run fixed_before /tmp/old --shape qwen2.5-0.5b
run fixed_after "$PWD" --shape qwen2.5-0.5b
run spread_after "$PWD" --shape qwen2.5-0.5b --lengths spread
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
          ("ms_per_decode_step", "fraction_of_hbm_floor", "mean_rows_per_step", "slots", "decode_s", "prefill_s", "reshard_s", "capture_s")}), json.dumps(d.get("peak_reserved_gib_by_phase")))
PY
tar czf "$OUT/cE.tgz" -C "$OUT" cE
