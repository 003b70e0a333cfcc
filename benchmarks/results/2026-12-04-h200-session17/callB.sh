#!/usr/bin/env bash
# Session 17, call B: the decode attention's prompt pass (one pass per lead slot over all its members'
# queries, then each sequence's own keys). The kernel alone at 0.5B and 3B, then the 0.5B GRPO step on the
# fixed workload with the code before this change (HEAD's decode_attention.py, decoder.py, engine.py from
# .carry/old.tgz, in a copy of the tree) and after, in this one call; then the spread workload at 0.5B and 3B.
set -u
O=$OUT/cB; mkdir -p "$O"
for s in qwen2.5-0.5b qwen2.5-3b; do
  timeout 120 python3 benchmarks/bench_decode_attention.py --shape $s --default-only --out "$O/attn_$s.json" \
    > "$O/attn_$s.log" 2>&1; echo "attn $s rc=$?"; tail -n 1 "$O/attn_$s.log" | cut -c1-2500
done
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
run spread_3b_after "$PWD" --shape qwen2.5-3b --lengths spread
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
          ("ms_per_decode_step", "fraction_of_hbm_floor", "mean_rows_per_step", "decode_s", "prefill_s")}))
PY
tar czf "$OUT/cB.tgz" -C "$OUT" cB
