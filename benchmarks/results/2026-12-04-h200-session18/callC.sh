#!/usr/bin/env bash
# Session 18, call C (refused: no machine lent; the next session's first call): the landed code as a whole
# (keep_cache=auto, the Triton log-prob kernels, torch's RMSNorm). bench_update_kernels.py again; the 0.5B
# GRPO step, fixed and spread, before (commit 5e42f90, /tmp/old: `git archive 5e42f90 | gzip > .carry/old.tgz`)
# and after in this call; 3B fixed and spread after.
set -u
O=$OUT/cC; mkdir -p "$O"
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .carry/old.tgz -C /tmp/old
timeout 120 python3 benchmarks/bench_update_kernels.py --out "$O/update_kernels.json" > "$O/update_kernels.log" 2>&1
echo "kernels rc=$?"; grep -v -i warn "$O/update_kernels.log" | tail -n 4 | cut -c1-420
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() {  # name, tree, limit, extra args
  local name=$1 tree=$2 lim=$3; shift 3
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$lim" python3 benchmarks/bench_rl_step.py --steps 3 \
    --out "$O/$name.json" "$@" "${K[@]}" > "$O/$name.log" 2>&1); echo "$name rc=$?"
  grep -v -i warn "$O/$name.log" | grep "s/step" | cut -c1-300
}
run fixed_new "$PWD" 100 --shape qwen2.5-0.5b
run spread_new "$PWD" 100 --shape qwen2.5-0.5b --lengths spread
run spread_old /tmp/old 100 --shape qwen2.5-0.5b --lengths spread
run fixed_3b_new "$PWD" 140 --shape qwen2.5-3b
run spread_3b_new "$PWD" 120 --shape qwen2.5-3b --lengths spread
python3 - "$O" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*_*.json")):
    if "kernels" in f:
        continue
    try:
        d = json.load(open(f)); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
    except Exception as e:
        print(f, "unreadable", e); continue
    print(f.split("/")[-1], json.dumps({k: r[k] for k in ("step_s", "step_over_roofline", "actor_update_mfu", "timing_s")}), json.dumps({k: last.get(k) for k in
          ("ms_per_decode_step", "fraction_of_hbm_floor", "capture_s")}), json.dumps(d.get("peak_reserved_gib_by_phase")))
PY
tar czf "$OUT/cC.tgz" -C "$OUT" cC
