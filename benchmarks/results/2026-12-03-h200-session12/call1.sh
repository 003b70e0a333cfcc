#!/usr/bin/env bash
# Session 12, call 1 (planned as call A, ~8 min): optim.gradient_accumulation_fusion off vs on (auto) in one call, 3B then
# 0.5B at the defaults, fixed workload; then one profiled 3B step with it on (the fp32 main-grad adds should
# be gone from the update's op table; call 1 of session 10 had ~0.39 s of them per step at 3B).
# Each stage is packed into its own $OUT/cA_*.tgz as soon as it ends (a cut call keeps what it packed).
set -u
O=$OUT/cA; mkdir -p "$O"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() { local cap=$1 name=$2; shift 2; local t0=$SECONDS; timeout "$cap" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS-t0))s"; grep -v -i warn "$O/$name.log" | tail -n 2 | cut -c1-600; }
for shape in qwen2.5-3b qwen2.5-0.5b; do
  cap=$([ $shape = qwen2.5-3b ] && echo 150 || echo 90)
  for f in false auto; do
    run $cap ${shape}_$f python3 benchmarks/bench_rl_step.py --shape $shape --steps 3 --out "$O/${shape}_$f.json" \
      "${K[@]}" actor.optim.gradient_accumulation_fusion=$f
    grep -h "gradient accumulation fusion" "$O/${shape}_$f.log"
  done
  tar czf "$OUT/cA_$shape.tgz" -C "$OUT" cA && rm -rf "$O" && mkdir -p "$O"
done
run 150 p3_fused python3 benchmarks/bench_rl_step.py --shape qwen2.5-3b --steps 1 --profile "$O/p3_fused" \
  --profile-update-seqs 128 --out "$O/p3_fused.json" "${K[@]}"
tar czf "$OUT/cA_profile.tgz" -C "$OUT" cA && rm -rf "$O"
