#!/usr/bin/env bash
# Session 10, call 1: op tables (torch.profiler, one untimed step after the timed ones) of generation and the
# update at 0.5B and 3B at the defaults, and at 0.5B with rollout.exact_logprobs=true; the exact matmul's
# tile sweep vs cuBLAS. Everything is packed into $OUT/c1.tgz (the device returns few files per call).
set -u
O=$OUT/c1; mkdir -p "$O"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run() { local cap=$1 name=$2; shift 2; local t0=$SECONDS; timeout "$cap" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS-t0))s"; tail -n 3 "$O/$name.log"; }
run 150 p05 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --steps 2 --profile "$O/p05" --out "$O/p05.json" "${K[@]}"
run 210 p3 python3 benchmarks/bench_rl_step.py --shape qwen2.5-3b --steps 2 --profile "$O/p3" --out "$O/p3.json" "${K[@]}"
run 140 px python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --steps 2 --profile "$O/px" --out "$O/px.json" \
  actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=16384 rollout.max_num_seqs=auto rollout.exact_logprobs=true
run 80 mm python3 benchmarks/bench_exact_matmul.py --shape qwen2.5-0.5b --out "$O/mm.json"
tar czf "$OUT/c1.tgz" -C "$OUT" c1 && rm -rf "$O"
