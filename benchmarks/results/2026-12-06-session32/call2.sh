#!/usr/bin/env bash
# Session 32, call 2 (within 30 s of session 29's call1.sh, which carries `.fa4a`, on the same held machine).
# Carry `.whl` and `.fa4b`'s wheels and `cu13.part_ab` (not `cb/`: the device has cuda-bindings).
# On an H200: issue 16's targets at this tree with FlashAttention-4 (session 27's callX.sh), then the A B B A
# below if time is left. On an H100: the fused residual add + RMSNorm alone (bench_update_kernels.py --cases
# addnorm), the 0.5B fixed step as A B B A with it on (this tree's default), off, off, on
# (MEGATRON_RL_FUSED_ADD_NORM; the second run of a pair is ~2% faster), the last with one more step profiled
# for the device's activity only (its idle time without the host profiler's overhead), then the 0.5B spread
# step (7 steps) if time is left.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c2; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; FA=1
source $D/steps.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" == *H200* ]]; then
  SKIP_3B=${SKIP_3B:-} GUARD=${GUARD:-570} bash benchmarks/results/2026-12-06-session27/callX.sh
  fi
timeout 90 python3 benchmarks/bench_update_kernels.py --cases addnorm --out "$O/update_kernels.json" \
  > "$O/update_kernels.log" 2>&1; echo "update_kernels rc=$? $((SECONDS - T0))s"; tail -2 "$O/update_kernels.log"
MEGATRON_RL_FUSED_ADD_NORM=1 run_step 130 fixed_on $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_FUSED_ADD_NORM=0 run_step 130 fixed_off $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_FUSED_ADD_NORM=0 run_step 130 fixed_off2 $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_FUSED_ADD_NORM=1 run_step 140 fixed_on2 $FA --steps 4 --shape qwen2.5-0.5b \
  --profile "$O/prof_dev" --profile-device-only
run_step 120 spread_on $FA --steps 7 --shape qwen2.5-0.5b --lengths spread
summary fixed_on fixed_off fixed_off2 fixed_on2 spread_on
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_on", "fixed_off", "fixed_off2", "fixed_on2", "spread_on"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]],
              "reward s", [round(s["timing_s"].get("reward", 0), 4) for s in d["steps"]])
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
for n in ("generate", "update"):
    try:
        g = json.load(open(f"{O}/prof_dev/{n}_gaps.json"))
        print(n, "device-only profile: wall s", round(g["wall_s_under_profiler"], 4), "busy s", round(g["busy_us"] / 1e6, 4),
              "idle in window s", round(g["idle_us"] / 1e6, 4), "gaps", g["gaps"],
              "top", [(round(t["start_us"] / 1e3, 1), round(t["us"])) for t in g["top"][:10]])
    except Exception as e:  # noqa: BLE001
        print(n, "gaps unreadable", e)
PY
[ -d "$O/prof_dev" ] && tar czf "$OUT/c2_prof.tgz" -C "$O" prof_dev && rm -rf "$O/prof_dev"
grep -h "failed its trial\|failed; it runs eagerly\|Error" "$O"/*.log | sort | uniq -c | head -8
tar czf "$OUT/c2_logs.tgz" -C "$O" $(cd "$O" && ls *.log); rm -f "$O"/*.log
