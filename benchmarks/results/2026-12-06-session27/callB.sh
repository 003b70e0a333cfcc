#!/usr/bin/env bash
# Session 27, call B: call A's 3B update ran at MFU 0.61-0.64 against call T's 0.83-0.84 (session 26, session
# 25's code + the async retire) while its generation took the same time. Same machine, one call: the 3B fixed
# step at HEAD (reward.overlap on), at call T's commit 8ec1812 (its tree unpacked in .old/, carried), and at HEAD
# with reward.overlap=false, with the GPU's clocks, power and throttle reasons logged every second.
# Carry `.whl` and `.old`; ~5 min.
set -u
O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-590} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE > "$O/smi_q.txt" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -l 1 > "$O/smi.csv" 2>&1 &
SMI=$!
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
A=(--steps 3 --shape qwen2.5-3b)
t 120 head_on python3 benchmarks/bench_rl_step.py "${A[@]}" --out "$O/head_on.json" "${K[@]}"
t 120 old env PYTHONPATH=/tmp/site:$PWD/.old bash -c 'cd .old && python3 benchmarks/bench_rl_step.py "$@"' _ "${A[@]}" --out "$O/old.json" "${K[@]}"
t 120 head_off python3 benchmarks/bench_rl_step.py "${A[@]}" --out "$O/head_off.json" "${K[@]}" reward.overlap=false
kill $SMI
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("head_on", "old", "head_off"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, "step", [round(s["step_s"], 3) for s in d["steps"]],
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "mfu", [round(s["actor_update_mfu"], 3) for s in d["steps"]],
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
PY
awk -F', ' 'NR > 1 {n++; c += $2; p += $4} END {if (n) printf "smi: %d samples, mean sm clock %.0f MHz, mean power %.0f W\n", n, c / n, p / n}' "$O/smi.csv"
echo "throttle reasons (count, mask):"; cut -d, -f7 "$O/smi.csv" | sort | uniq -c | sort -rn | head -6
grep -i -A3 "power limit\|clocks event\|throttle" "$O/smi_q.txt" | head -40
