#!/usr/bin/env bash
# Session 18, call B: the update's new kernels alone (bench_update_kernels.py: Triton log-prob passes vs the
# compiled ones, compiled RMSNorm vs torch's), then the 0.5B GRPO step, fixed workload: the tree before this
# session (commit 5e42f90 from .carry/old.tgz, unpacked in /tmp/old) against the new tree, and the new tree
# with the Triton log-prob off (MEGATRON_RL_TRITON_LOGPROB=0: keeps the compiled RMSNorm and keep_cache=auto);
# the spread workload on the new tree.
set -u
O=$OUT/cB; mkdir -p "$O"
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .carry/old.tgz -C /tmp/old
timeout 150 python3 benchmarks/bench_update_kernels.py --out "$O/update_kernels.json" > "$O/update_kernels.log" 2>&1
echo "kernels rc=$?"; grep -v -i warn "$O/update_kernels.log" | tail -n 4 | cut -c1-600
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() {  # name, tree, extra args
  local name=$1 tree=$2; shift 2
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 110 python3 benchmarks/bench_rl_step.py --steps 3 \
    --out "$O/$name.json" "$@" "${K[@]}" > "$O/$name.log" 2>&1); echo "$name rc=$?"
  grep -v -i warn "$O/$name.log" | grep "memory plan\|s/step" | cut -c1-700
}
run fixed_new "$PWD" --shape qwen2.5-0.5b
run fixed_old /tmp/old --shape qwen2.5-0.5b
MEGATRON_RL_TRITON_LOGPROB=0 run fixed_new_nolp "$PWD" --shape qwen2.5-0.5b
run spread_new "$PWD" --shape qwen2.5-0.5b --lengths spread
python3 - "$O" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*_*.json")):
    if "kernels" in f:
        continue
    try:
        d = json.load(open(f)); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
    except Exception as e:
        print(f, "unreadable", e); continue
    print(f.split("/")[-1], json.dumps(r), json.dumps({k: last.get(k) for k in
          ("ms_per_decode_step", "fraction_of_hbm_floor", "decode_s", "prefill_s", "reshard_s", "capture_s")}), json.dumps(d.get("peak_reserved_gib_by_phase")))
PY
tar czf "$OUT/cB.tgz" -C "$OUT" cB
