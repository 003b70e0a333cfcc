#!/usr/bin/env bash
# Session 17, call A: the decode attention split over keys (flash-decoding, `decode_attention.CHUNK`).
# The kernel alone (sweep at 0.5B, defaults at 3B), then the 0.5B GRPO step with the split off and on
# (MEGATRON_RL_DECODE_CHUNK=0 / default 256) on the fixed workload, and the spread workload with it on.
set -u
O=$OUT/cA; mkdir -p "$O"
timeout 240 python3 benchmarks/bench_decode_attention.py --shape qwen2.5-0.5b --out "$O/attn_0.5b.json" \
  > "$O/attn_0.5b.log" 2>&1; echo "attn 0.5b rc=$?"; tail -n 2 "$O/attn_0.5b.log" | cut -c1-1500
timeout 90 python3 benchmarks/bench_decode_attention.py --shape qwen2.5-3b --default-only --out "$O/attn_3b.json" \
  > "$O/attn_3b.log" 2>&1; echo "attn 3b rc=$?"; tail -n 1 "$O/attn_3b.log" | cut -c1-1500
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
for chunk in 0 256; do
  MEGATRON_RL_DECODE_CHUNK=$chunk timeout 150 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b \
    --steps 3 --out "$O/fixed_c$chunk.json" "${K[@]}" > "$O/fixed_c$chunk.log" 2>&1; echo "fixed chunk=$chunk rc=$?"
  grep -v -i warn "$O/fixed_c$chunk.log" | tail -n 2 | cut -c1-400
done
timeout 150 python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b --lengths spread --steps 3 \
  --out "$O/spread_c256.json" "${K[@]}" > "$O/spread_c256.log" 2>&1; echo "spread rc=$?"
grep -v -i warn "$O/spread_c256.log" | tail -n 2 | cut -c1-400
python3 - "$O" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*_c*.json")):
    try:
        d = json.load(open(f)); r = d["median_after_warmup"]; last = d["steps"][-1]["decode"]
    except Exception as e:
        print(f, "unreadable", e); continue
    print(f.split("/")[-1], json.dumps(r), json.dumps({k: last.get(k) for k in
          ("ms_per_decode_step", "fraction_of_hbm_floor", "mean_rows_per_step", "decode_s", "prefill_s")}))
PY
tar czf "$OUT/cA.tgz" -C "$OUT" cA
