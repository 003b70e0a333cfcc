#!/usr/bin/env bash
# Session 32, call 3 (within 30 s of session 29's call1.sh, which carries `.fa4a`, on the same held machine).
# Carry `.whl`, `.fa4b`'s wheels and `cu13.part_ab` (not `cb/`) and `.old`: session 31's last commit, from
# `git archive 206370a megatron_rl configs benchmarks/{bench_rl_step,_timing,device_gaps,sync_audit,make_synthetic_gsm8k,spread_lengths}.py`.
# On an H200: issue 16's targets at this tree (session 27's callX.sh). On an H100: the fused add + RMSNorm's
# backward swept alone (bench_update_kernels.py --cases addnorm), then the 0.5B fixed step as A B B A, this
# tree against `.old` (the fused add + norm and the background detokenising together), the last run with one
# more step profiled for the device's activity only (is the gap after the first forward gone?).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c3; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; FA=1
source $D/steps.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" == *H200* ]]; then
  GUARD=${GUARD:-570} bash benchmarks/results/2026-12-06-session27/callX.sh; rm -rf "$O"; exit; fi
old() { local name=$1; shift
  if (( SECONDS - T0 + 130 > ${GUARD:-570} )); then echo "$name skipped"; return; fi
  PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.old MEGATRON_RL_FA4=$FA timeout 130 \
    bash -c 'cd .old && python3 benchmarks/bench_rl_step.py "$@"' _ "$@" --out "$O/$name.json" "${K[@]}" \
    > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
timeout 90 python3 benchmarks/bench_update_kernels.py --cases addnorm --out "$O/update_kernels.json" \
  > "$O/update_kernels.log" 2>&1; echo "update_kernels rc=$? $((SECONDS - T0))s"; tail -2 "$O/update_kernels.log"
run_step 130 fixed_new $FA --steps 4 --shape qwen2.5-0.5b
old fixed_old --steps 4 --shape qwen2.5-0.5b
old fixed_old2 --steps 4 --shape qwen2.5-0.5b
run_step 140 fixed_new2 $FA --steps 4 --shape qwen2.5-0.5b --profile "$O/prof_dev" --profile-device-only
summary fixed_new fixed_old fixed_old2 fixed_new2
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_new", "fixed_old", "fixed_old2", "fixed_new2"):
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
              "idle in window s", round(g["idle_us"] / 1e6, 4), "in gaps >= 20 us", round(g["idle_in_gaps_us"] / 1e6, 4),
              "top", [(round(t["start_us"] / 1e3, 1), round(t["us"])) for t in g["top"][:10]])
    except Exception as e:  # noqa: BLE001
        print(n, "gaps unreadable", e)
PY
[ -d "$O/prof_dev" ] && tar czf "$OUT/c3_prof.tgz" -C "$O" prof_dev && rm -rf "$O/prof_dev"
grep -h "failed its trial\|failed; it runs eagerly\|Error" "$O"/*.log | sort | uniq -c | head -8
tar czf "$OUT/c3_logs.tgz" -C "$O" $(cd "$O" && ls *.log); rm -f "$O"/*.log
