#!/usr/bin/env bash
# Session 29, call 7 (same held machine, right after call 6; run as this one command line): a third A/B pair
# of the 0.5B fixed step on call 6's machine, FA4 first. Carry `.whl`. ~2 min.
D=benchmarks/results/2026-12-06-session29; O=$OUT/c7; mkdir -p $O; T0=$SECONDS; source $D/fa4_env.sh; source $D/steps.sh; GUARD=300; run_step 120 fixed_fa4_c 1 --steps 4 --shape qwen2.5-0.5b; run_step 120 fixed_nofa4_c 0 --steps 4 --shape qwen2.5-0.5b; summary fixed_fa4_c fixed_nofa4_c
