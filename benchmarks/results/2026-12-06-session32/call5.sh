#!/usr/bin/env bash
# Session 32, call 5 (within 30 s of session 29's call1.sh, which carries `.fa4a`, on the same held machine).
# Carry `.whl`, `.fa4b`'s wheels and `cu13.part_ab` (not `cb/`). The 0.5B fixed step as A B B A with the
# detokenising child process on (opt-in), off, off, on (MEGATRON_RL_DETOKENIZE_PROCESS), the last with one more
# step profiled for the device's activity only (the gap after the first forward; the bias add's time a call
# after its larger trial). ~330-400 s. Session 32 ran it inline with limits of 80 and 72 s a run on a fresh
# machine: both runs timed out in their first step's compiles (its `c5/`); the limits here allow for them.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c5; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; FA=1
source $D/steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader
MEGATRON_RL_DETOKENIZE_PROCESS=1 run_step 150 fixed_on $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DETOKENIZE_PROCESS=0 run_step 110 fixed_off $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DETOKENIZE_PROCESS=0 run_step 110 fixed_off2 $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DETOKENIZE_PROCESS=1 run_step 130 fixed_on2 $FA --steps 4 --shape qwen2.5-0.5b \
  --profile "$O/prof_dev" --profile-device-only
summary fixed_on fixed_off fixed_off2 fixed_on2
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_on", "fixed_off", "fixed_off2", "fixed_on2"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, "reward s", [round(s["timing_s"].get("reward", 0), 4) for s in d["steps"]])
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
try:
    g = json.load(open(f"{O}/prof_dev/update_gaps.json"))
    print("update device-only profile: wall s", round(g["wall_s_under_profiler"], 4), "busy s", round(g["busy_us"] / 1e6, 4),
          "idle s", round(g["idle_us"] / 1e6, 4), "in gaps >= 20 us", round(g["idle_in_gaps_us"] / 1e6, 4),
          "top", [(round(t["start_us"] / 1e3, 1), round(t["us"])) for t in g["top"][:10]])
except Exception as e:  # noqa: BLE001
    print("gaps unreadable", e)
PY
[ -f "$O/prof_dev/update_ops.txt" ] && grep -E "fused_add_0|fused_sum_0|_add_forward" "$O/prof_dev/update_ops.txt" | cut -c1-95,150-280
[ -d "$O/prof_dev" ] && tar czf "$OUT/c5_prof.tgz" -C "$O" prof_dev && rm -rf "$O/prof_dev"
grep -h "failed its trial\|failed; it runs eagerly\|detokenising process\|Error" "$O"/*.log | sort | uniq -c | head -8
tar czf "$OUT/c5_logs.tgz" -C "$O" $(cd "$O" && ls *.log); rm -f "$O"/*.log
