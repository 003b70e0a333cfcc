#!/usr/bin/env bash
# Session 30, call 2b (on call 2's held machine; carry `.whl` and `.old` with benchmarks/make_synthetic_gsm8k.py
# added from 87500a0): the 0.5B fixed step at session 29's tree, 4 steps, no FA4. ~50 s.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p $OUT/c2b; cd .old && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/bench_rl_step.py --steps 4 \
  --shape qwen2.5-0.5b --out $OUT/c2b/fixed_s29.json actor.use_dynamic_bsz=true \
  actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto > $OUT/c2b/fixed_s29.log 2>&1; echo rc=$?
