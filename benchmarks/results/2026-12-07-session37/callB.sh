#!/usr/bin/env bash
# Session 37, call B (carry `.whl`, `.old`): the two-level draw (`rollout.sampling.block_race`) against the
# per-token draw it replaced (`.old/old_sampler.py` = `git show 3729cad:megatron_rl/kernels/sampler.py`):
# (1) the sampler alone, A B B A in one process (`bench_sampler.py --old`); (2) the decode step, A B B A in one
# process, and its profiled split (`decode_step_parts.py --old-sampler`); (3) the 0.5B fixed GRPO step at
# this tree and at 3729cad's (`.old/s36` = `git archive 3729cad megatron_rl pyproject.toml benchmarks/*.py`),
# new / old / new order; on an H200, time left, the 3B fixed step. Guarded (GUARD, default 570 s).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
timeout 150 python3 benchmarks/bench_sampler.py --rows 128,512 --key-sets 8 --old .old/old_sampler.py \
  --out "$O/a_sampler.json" > "$O/a_sampler.log" 2>&1
echo "sampler rc=$? $((SECONDS - T0))s"; grep -v Warning "$O/a_sampler.log" | tail -3 | cut -c1-1500
timeout 200 python3 benchmarks/decode_step_parts.py --old-sampler .old/old_sampler.py \
  --out "$O/b_decode_parts.json" > "$O/b_parts.log" 2>&1
echo "parts rc=$? $((SECONDS - T0))s"; grep -v "^  " "$O/b_parts.log" | grep -v Warning | tail -12 | cut -c1-400
grep -A6 "tail_kernels" "$O/b_parts.log" | cut -c1-120
source $D/steps.sh
run_step 110 c_fixed_new 0 --steps 3 --shape qwen2.5-0.5b
(cd .old/s36 && O=$O T0=$T0 GUARD=${GUARD:-570} bash -c "source ../../$D/steps.sh; PYTHONPATH=/tmp/site:\$PWD run_step 110 d_fixed_old 0 --steps 3 --shape qwen2.5-0.5b")
run_step 110 e_fixed_new2 0 --steps 3 --shape qwen2.5-0.5b
summary c_fixed_new d_fixed_old e_fixed_new2
if [[ "$GPU" == *H200* ]]; then
  run_step 250 f_fixed_3b 0 --steps 3 --shape qwen2.5-3b
  summary f_fixed_3b
fi
