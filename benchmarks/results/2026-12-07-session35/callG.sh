#!/usr/bin/env bash
# Session 35, call G (carry `.whl`; no FA4). (1) decode attention with the prompt read once per window of 2 / 4
# / 8 adjacent slots against the engine's kernel (bench_decode_attention --default-only, 0.5B; 3B after (2)); (2) if a
# window size is >= 5% faster at 0.5B (adjacent slots, as the engine admits them), the 0.5B fixed step with it
# (MEGATRON_RL_DECODE_WINDOWS) and without, W P P W; (3) where the fused LM head + draw loses (diag_head.py);
# (4) the 0.5B fixed step profiled, if the guard allows. ~5-8 min (GUARD, default 450 s). Files are named so that
# the ones that matter sort first (a device call returns its first files when it returns only some).
set -u
O=$OUT/cG; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
attn() { timeout $2 python3 benchmarks/bench_decode_attention.py --default-only --shape $1 --out "$O/a_attn_$1.json" \
  >> "$O/run.log" 2>&1; echo "attn $1 rc=$? $((SECONDS - T0))s"; }
attn qwen2.5-0.5b 120
BEST=$(python3 - "$O" <<'PY'
import json, sys
best = None
for s in ("qwen2.5-0.5b", "qwen2.5-3b"):
    try:
        r = json.load(open(f"{sys.argv[1]}/a_attn_{s}.json"))["prompt_kv_sharing"]
        for lay in ("adjacent", "scattered"):
            print(s, lay, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r[lay].items()}, file=sys.stderr)
        if s == "qwen2.5-0.5b":
            a = r["adjacent"]
            c = [(v, k) for k, v in a.items() if k.startswith("windows_m") and k.endswith("_w4_us") and isinstance(v, float)
                 and a.get(k[:-3] + "_max_diff_vs_shared", 1) < 2e-2]
            if c and min(c)[0] < 0.95 * a["us_shared"]:
                best = min(c)[1].split("_")[1][1:]
    except Exception as e:  # noqa: BLE001
        print(s, "unreadable", e, file=sys.stderr)
print(best or "")
PY
)
echo "best window: ${BEST:-none}"
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
st() { local name=$1 w=$2; if (( SECONDS - T0 + 80 > ${GUARD:-450} )); then echo "$name skipped (time)"; return; fi
  MEGATRON_RL_DECODE_WINDOWS=$w timeout 80 python3 benchmarks/bench_rl_step.py --steps 3 --shape qwen2.5-0.5b \
    --out "$O/c_$name.json" "${K[@]}" >> "$O/b_steps.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"
  python3 -c "
import json; d = json.load(open('$O/c_$name.json'))
print('$name', 'step', [round(s['step_s'], 3) for s in d['steps']], 'decode ms', [round(s['decode']['ms_per_decode_step'], 4) for s in d['steps']])" 2>&1 | tail -1
  grep -h "failed its trial" "$O/b_steps.log" | sort | uniq -c | head -2; }
if [ -n "$BEST" ]; then st win1 $BEST; st plain1 0; st plain2 0; st win2 $BEST; fi
(( SECONDS - T0 + 100 < ${GUARD:-450} )) && attn qwen2.5-3b 100
python3 -c "
import json; a = json.load(open('$O/a_attn_qwen2.5-3b.json'))['prompt_kv_sharing']['adjacent']
print('3b adjacent', {k: (round(v, 3) if isinstance(v, float) else v) for k, v in a.items()})" 2>/dev/null
if (( SECONDS - T0 + 90 < ${GUARD:-450} )); then
  timeout 90 python3 benchmarks/results/2026-12-07-session35/diag_head.py --out "$O/d_diag_head.json" >> "$O/run.log" 2>&1
  echo "diag rc=$? $((SECONDS - T0))s"; grep -E "_us |Error" "$O/run.log" | head -12
fi
if (( SECONDS - T0 + 170 < ${GUARD:-450} )); then
  timeout 170 python3 benchmarks/bench_rl_step.py --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" \
    --profile "$O/prof" "${K[@]}" >> "$O/run.log" 2>&1; echo "prof rc=$? $((SECONDS - T0))s"
  head -40 "$O/prof/generate_ops.txt" | cut -c1-90,150-170
  tar czf "$O/e_prof.tgz" -C "$O" prof && rm -rf "$O/prof"
fi
grep -iE "error|Traceback" "$O/run.log" | head -5
