#!/usr/bin/env bash
# Prepared in session 24 for the next device call (session 24 got no machine: every start failed; session 23's
# callR.sh never ran either). The GPU check of the decode graphs (session 22's finer buckets, never yet run on a
# GPU), then the fused decode GEMMs (kernels/decode_gemm.py: qkv + RoPE + KV write, fc1 + SwiGLU, fc2 / proj as
# split-K with the sum inside add + RMSNorm) against cuBLAS per part and row count (bench_decode_gemm.py writes
# the table of settings that win), then the 0.5B spread and fixed steps without the table (the tree as it is:
# the built-in table is empty; these carry session 23's sync audit) and with it (MEGATRON_RL_DECODE_GEMM_TABLE),
# the on-runs only where the table has a winning entry. Carry `.whl`; ~8-9 min on an H100 or H200.
# GUARD (seconds for all parts, default 590), GEMM_S (the GEMM bench's limit, default 200 s: ~120 Triton
# compiles on a fresh machine), GEMM_ARGS (its arguments, default --rows 16,32,64,128,256) and SKIP_CHECK=1 shorten
# it; a part that would pass GUARD is skipped (the "on" runs come after their baselines).
set -u
O=$OUT/cS; mkdir -p "$O"; T0=$SECONDS
t() { local lim=$1 name=$2; shift 2; if (( SECONDS - T0 + lim > ${GUARD:-590} )); then echo "$name skipped (time)"; return; fi
  timeout "$lim" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
B=(python3 benchmarks/bench_rl_step.py --shape qwen2.5-0.5b)
TAB=$O/decode_gemm_table.json
[ -z "${SKIP_CHECK:-}" ] && t 70 check_graphs python3 benchmarks/check_decode_graphs.py --out "$O/check_decode_graphs.json"  # exits 1 on a problem
t "${GEMM_S:-200}" gemm python3 benchmarks/bench_decode_gemm.py --out "$O/decode_gemm.json" --table "$TAB" ${GEMM_ARGS:---rows 16,32,64,128,256}
t 90 spread_off "${B[@]}" --steps 4 --lengths spread --out "$O/spread_off.json" --sync-audit "$O/syncs_spread.json" "${K[@]}"
WIN=$(python3 -c 'import json, sys; t = json.load(open(sys.argv[1]))
print(int(any(v for p in t["parts"].values() for v in p["rows"].values())))' "$TAB" 2>/dev/null || echo 0)
echo "table has a winning entry: $WIN"
[ "$WIN" = 1 ] && t 90 spread_on env MEGATRON_RL_DECODE_GEMM_TABLE="$TAB" "${B[@]}" --steps 4 --lengths spread --out "$O/spread_on.json" "${K[@]}"
t 110 fixed_off "${B[@]}" --steps 4 --out "$O/fixed_off.json" --sync-audit "$O/syncs_fixed.json" "${K[@]}"
[ "$WIN" = 1 ] && t 110 fixed_on env MEGATRON_RL_DECODE_GEMM_TABLE="$TAB" "${B[@]}" --steps 4 --out "$O/fixed_on.json" "${K[@]}"
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
try:
    print("check_graphs problems:", json.load(open(f"{O}/check_decode_graphs.json"))["problems"])
except Exception as e:
    print("check_graphs unreadable", e)
try:
    g = json.load(open(f"{O}/decode_gemm.json"))
    for part, rows in g["parts"].items():  # per row count: (cuBLAS us, fused us) after the recheck
        print(part, {r: (round(v["cublas_us"], 2), v["best"] and round(v["best"]["us"], 2)) for r, v in rows.items()})
    print("table", open(f"{O}/decode_gemm_table.json").read().replace("\n", ""))
except Exception as e:
    print("decode_gemm unreadable", e)
for f in ("spread_off", "spread_on", "fixed_off", "fixed_on"):
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, json.dumps({k: r.get(k) for k in ("step_s", "step_over_roofline", "step_over_roofline_this_gpu",
                                                   "decode_fraction_of_hbm_floor", "timing_s")}),
              "sync host s", [round(s["decode"].get("sync_host_s", -1), 3) for s in d["steps"]],
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]],
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]])
    except Exception as e:
        print(f, "unreadable", e)
for f in ("syncs_fixed", "syncs_spread"):
    try:
        a = json.load(open(f"{O}/{f}.json"))
        print(f, a["syncs"], "syncs;", {p: v["syncs"] for p, v in a["phases"].items()}, "top sites",
              dict(list(a["sites"].items())[:12]))
    except Exception as e:
        print(f, "unreadable", e)
PY
tar czf "$OUT/cS.tgz" -C "$OUT" cS
