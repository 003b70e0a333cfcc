#!/usr/bin/env bash
# Session 33, call C (within 30 s of call B, same held machine, which keeps /tmp/site and call B's tables in
# /tmp). Carry `.whl`. The 0.5B fixed step as A B B A: A with call B's table in force
# (MEGATRON_RL_DECODE_GEMM_TABLE: cuBLAS split-K for fc2 / proj where it won) and the detokenising child
# process (MEGATRON_RL_DETOKENIZE_PROCESS=1), B with neither. Decode ms a step tells the table's effect (the
# child process does not touch generation); the update's time (with the scoring inside) the child's. The
# last run also records a device-only profile. ~400-480 s.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cC; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; FA=1
source $D/steps.sh
TB=${TABLE:-/tmp/table_05b.json}
nvidia-smi --query-gpu=name --format=csv,noheader
MEGATRON_RL_DECODE_GEMM_TABLE=$TB MEGATRON_RL_DETOKENIZE_PROCESS=1 run_step 140 fixed_on $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DETOKENIZE_PROCESS=0 run_step 105 fixed_off $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DETOKENIZE_PROCESS=0 run_step 105 fixed_off2 $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DECODE_GEMM_TABLE=$TB MEGATRON_RL_DETOKENIZE_PROCESS=1 run_step 125 fixed_on2 $FA --steps 4 \
  --shape qwen2.5-0.5b --profile "$O/prof_dev" --profile-device-only
summary fixed_on fixed_off fixed_off2 fixed_on2
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_on", "fixed_off", "fixed_off2", "fixed_on2"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, "decode ms", [round(s["decode"]["ms_per_decode_step"], 4) for s in d["steps"]],
              "reward s", [round(s["timing_s"].get("reward", 0), 4) for s in d["steps"]])
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
try:
    g = json.load(open(f"{O}/prof_dev/update_gaps.json"))
    print("update device-only: wall s", round(g["wall_s_under_profiler"], 4), "busy s", round(g["busy_us"] / 1e6, 4),
          "idle s", round(g["idle_us"] / 1e6, 4), "top gaps", [(round(t["start_us"] / 1e3, 1), round(t["us"])) for t in g["top"][:8]])
except Exception as e:  # noqa: BLE001
    print("gaps unreadable", e)
PY
for n in generate update; do [ -f "$O/prof_dev/${n}_ops.txt" ] && head -22 "$O/prof_dev/${n}_ops.txt" | cut -c1-92,150-230; done
[ -f "$O/prof_dev/update_ops.txt" ] && grep -E "fused_add_0|fused_sum_0" "$O/prof_dev/update_ops.txt" | cut -c1-92,150-230
[ -d "$O/prof_dev" ] && tar czf "$OUT/cC_prof.tgz" -C "$O" prof_dev && rm -rf "$O/prof_dev"
grep -h "failed its trial\|failed; it runs\|detokenising process\|Error\|split-K\|decode GEMM" "$O"/*.log | sort | uniq -c | head -8
tar czf "$OUT/cC_logs.tgz" -C "$O" $(cd "$O" && ls *.log); rm -f "$O"/*.log
