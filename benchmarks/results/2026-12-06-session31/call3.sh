#!/usr/bin/env bash
# Session 31, calls 3 and 4 (typed inline on the machine call2.sh had just used; kept here as run). Carry as call2.sh.
# Call 3: the 0.5B spread step at this tree, then at `.old` (which failed at import: the archive lacked
# benchmarks/spread_lengths.py); call 4: `.old` again with that file copied in (unchanged since db610c0).
D=benchmarks/results/2026-12-06-session29; O=$OUT/c3; mkdir -p $O; T0=$SECONDS
source $D/fa4_env.sh >/dev/null 2>&1; source $D/steps.sh; GUARD=225
if [ -z "${CALL4:-}" ]; then run_step 110 spread_new 1 --steps 6 --shape qwen2.5-0.5b --lengths spread; fi
PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.old MEGATRON_RL_FA4=1 timeout 100 \
  bash -c 'cd .old && python3 benchmarks/bench_rl_step.py "$@"' _ --steps 6 --shape qwen2.5-0.5b --lengths spread \
  --out "$O/spread_old.json" "${K[@]}" > $O/spread_old.log 2>&1; echo "spread_old rc=$? $((SECONDS - T0))s"
summary spread_new spread_old
