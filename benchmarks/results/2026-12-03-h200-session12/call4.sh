#!/usr/bin/env bash
# Session 12, call 4 (planned as call A2, ~6 min): rollout.prompt_kv_sharing. The decode kernel alone (default config, batch
# 512, groups of 8 slots holding one prompt: each read from its own copy vs from the group's lead; adjacent
# and scattered slots), then the whole step with sharing off at 0.5B and 3B, to set against call A's
# "*_auto" runs (sharing on, fusion auto). Each stage is packed into its own $OUT/cA2_*.tgz.
set -u
O=$OUT/cA2; mkdir -p "$O"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
for shape in qwen2.5-0.5b qwen2.5-3b; do
  timeout 60 python3 benchmarks/bench_decode_attention.py --shape $shape --default-only \
    --out "$O/attn_$shape.json" 2>&1 | grep -v -i warn | tail -n 2 | cut -c1-900
done
tar czf "$OUT/cA2_kernel.tgz" -C "$OUT" cA2 && rm -rf "$O" && mkdir -p "$O"
for shape in qwen2.5-0.5b qwen2.5-3b; do
  cap=$([ $shape = qwen2.5-3b ] && echo 150 || echo 90); t0=$SECONDS
  timeout $cap python3 benchmarks/bench_rl_step.py --shape $shape --steps 3 --out "$O/${shape}_noshare.json" \
    "${K[@]}" rollout.prompt_kv_sharing=false > "$O/${shape}_noshare.log" 2>&1
  echo "$shape noshare rc=$? $((SECONDS-t0))s"; grep -v -i warn "$O/${shape}_noshare.log" | tail -n 1 | cut -c1-600
done
tar czf "$OUT/cA2_step.tgz" -C "$OUT" cA2 && rm -rf "$O"
