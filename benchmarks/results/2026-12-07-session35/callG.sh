#!/usr/bin/env bash
# Session 35, call G (carry `.whl`; no FA4): call F without quack, for a small budget. (1) decode attention with
# the prompt read once per window of 2 / 4 / 8 adjacent slots against the engine's kernel (bench_decode_attention
# --default-only, 0.5B and 3B); (2) where the fused LM head + draw loses (diag_head.py); (3) the 0.5B fixed step
# profiled if the guard allows. ~4-6 min (GUARD, default 400 s).
set -u
O=$OUT/cG; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for S in qwen2.5-0.5b qwen2.5-3b; do
  timeout 75 python3 benchmarks/bench_decode_attention.py --default-only --shape $S --out "$O/attn_$S.json" >> "$O/run.log" 2>&1
  echo "attn $S rc=$? $((SECONDS - T0))s"
done
python3 - "$O" <<'PY'
import json, sys
for s in ("qwen2.5-0.5b", "qwen2.5-3b"):
    try:
        r = json.load(open(f"{sys.argv[1]}/attn_{s}.json"))["prompt_kv_sharing"]
        for lay in ("adjacent", "scattered"):
            print(s, lay, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r[lay].items()})
    except Exception as e:  # noqa: BLE001
        print(s, "unreadable", e)
PY
timeout 100 python3 benchmarks/results/2026-12-07-session35/diag_head.py --out "$O/diag_head.json" >> "$O/run.log" 2>&1
echo "diag rc=$? $((SECONDS - T0))s"; grep -E "_us |Error" "$O/run.log" | head -12
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
if (( SECONDS - T0 + 170 < ${GUARD:-400} )); then
  timeout 170 python3 benchmarks/bench_rl_step.py --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" \
    --profile "$O/prof" "${K[@]}" > "$O/prof.log" 2>&1; echo "prof rc=$? $((SECONDS - T0))s"
  head -40 "$O/prof/generate_ops.txt" | cut -c1-90,150-170
  tar czf "$O/prof.tgz" -C "$O" prof && rm -rf "$O/prof"
fi
grep -iE "error|Traceback" "$O/run.log" | head -5
