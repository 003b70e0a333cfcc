#!/usr/bin/env bash
# Session 33, call F (run inline as one command line; this file is that line, unfolded). After session 29's
# call1.sh (carry `.fa4a`) on the same held machine; carry `.whl`, `.fa4b`'s wheels and `cu13.part_ab` (not
# `cb/`) and call E's `cE/table_05b.json` (in the tree). The 0.5B fixed step at the defaults with FA4
# (`fixed`), then with call E's table in force and the detokenising child process on (`fixed_on`). ~140 s.
D=benchmarks/results/2026-12-06-session29; O=$OUT/cF; mkdir -p $O; T0=$SECONDS
source $D/fa4_env.sh; source $D/steps.sh; GUARD=330
nvidia-smi --query-gpu=name --format=csv,noheader
run_step 215 fixed 1 --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DECODE_GEMM_TABLE=benchmarks/results/2026-12-06-session33/cE/table_05b.json MEGATRON_RL_DETOKENIZE_PROCESS=1 \
  run_step 100 fixed_on 1 --steps 3 --shape qwen2.5-0.5b
summary fixed fixed_on
python3 -c "
import json,sys
for f in ('fixed','fixed_on'):
    try:
        d=json.load(open('$O/'+f+'.json')); print(f, 'decode ms', [round(s['decode']['ms_per_decode_step'],4) for s in d['steps']], 'decode frac', d['median_after_warmup'].get('decode_fraction_of_hbm_floor'), 'reward', [round(s['timing_s'].get('reward',0),4) for s in d['steps']])
    except Exception as e: print(f, e)
"
grep -h "failed its trial\|Error\|detokenising" $O/*.log | sort | uniq -c | head -5
