#!/usr/bin/env bash
# Session 18, call A: measure before optimising. The 0.5B fixed step at the defaults with one more step under
# torch.profiler (the update of its first 64 sequences); 3B fixed at HEAD (the capture change and the review
# fixes of session 17 were not run at 3B); the 0.5B spread workload with and without rollout.keep_cache.
set -u
O=$OUT/cA; mkdir -p "$O"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() {  # name, limit, extra args
  local name=$1 lim=$2; shift 2
  timeout "$lim" python3 benchmarks/bench_rl_step.py --steps 3 --out "$O/$name.json" "$@" "${K[@]}" \
    > "$O/$name.log" 2>&1; echo "$name rc=$?"
  grep -v -i warn "$O/$name.log" | tail -n 2 | cut -c1-400
}
run fixed_prof 170 --shape qwen2.5-0.5b --profile "$O/prof" --profile-update-seqs 64
run fixed_3b 170 --shape qwen2.5-3b
run spread 100 --shape qwen2.5-0.5b --lengths spread
run spread_keep 100 --shape qwen2.5-0.5b --lengths spread rollout.keep_cache=true
python3 - "$O" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    try:
        d = json.load(open(f)); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
    except Exception as e:
        print(f, "unreadable", e); continue
    print(f.split("/")[-1], json.dumps(r), json.dumps({k: last.get(k) for k in
          ("ms_per_decode_step", "fraction_of_hbm_floor", "mean_rows_per_step", "slots", "decode_s", "prefill_s", "reshard_s", "capture_s")}), json.dumps(d.get("peak_reserved_gib_by_phase")))
PY
head -n 40 "$O/prof/update_ops.txt" | cut -c1-92,150-200
head -n 30 "$O/prof/generate_ops.txt" | cut -c1-92,150-200
tar czf "$OUT/cA.tgz" -C "$OUT" cA
