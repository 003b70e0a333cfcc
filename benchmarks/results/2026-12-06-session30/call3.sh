#!/usr/bin/env bash
# Session 30, call 3 (on call 2's held machine, FA4 already installed there; carry `.whl` and `.old`): the 0.5B
# spread step at this session's tree and at session 29's (87500a0, `.old`), 7 steps each (6 timed), in the
# order B A B A where the time allows (A = this session). ~7 min for all four.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c3; mkdir -p "$O"; T0=$SECONDS
source $D/fa4_env.sh; source $D/steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader
old() { local name=$1; if (( SECONDS - T0 + 110 > ${GUARD:-570} )); then echo "$name skipped (time)"; return; fi
  PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.old timeout 110 \
  bash -c 'cd .old && python3 benchmarks/bench_rl_step.py "$@"' _ --steps 7 --shape qwen2.5-0.5b --lengths spread \
  --out "$O/$name.json" "${K[@]}" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
old spread_s29_a
run_step 110 spread_s30_a 1 --steps 7 --shape qwen2.5-0.5b --lengths spread
old spread_s29_b
run_step 110 spread_s30_b 1 --steps 7 --shape qwen2.5-0.5b --lengths spread
summary spread_s29_a spread_s30_a spread_s29_b spread_s30_b
tar czf "$OUT/c3_logs.tgz" -C "$O" $(cd "$O" && ls *.log); rm -f "$O"/*.log
