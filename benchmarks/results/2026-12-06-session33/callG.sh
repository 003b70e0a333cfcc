#!/usr/bin/env bash
# Session 33, call G (run inline; this file is that line, unfolded), right after call F on the same held
# machine (FA4 already in /tmp/site); carry `.whl`. The 0.5B spread step (5 steps) and the fixed step once more
# (3 steps), both at the defaults with FA4. ~110 s.
D=benchmarks/results/2026-12-06-session29; O=$OUT/cG; mkdir -p $O; T0=$SECONDS
source $D/fa4_env.sh >/dev/null; source $D/steps.sh; GUARD=195
run_step 105 spread 1 --steps 5 --shape qwen2.5-0.5b --lengths spread
run_step 85 fixed2 1 --steps 3 --shape qwen2.5-0.5b
summary spread fixed2
python3 -c "
import json
for f in ('spread','fixed2'):
    try:
        d=json.load(open('$O/'+f+'.json')); print(f, 'decode ms', [round(s['decode']['ms_per_decode_step'],4) for s in d['steps']], 'padded', d['median_after_warmup'].get('padded_fraction'))
    except Exception as e: print(f, e)
"
