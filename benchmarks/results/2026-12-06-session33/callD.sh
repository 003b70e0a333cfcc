#!/usr/bin/env bash
# Session 33, call D: one call, carry `.whl` only (no FlashAttention-4: aten's flash attention in the update,
# the same in every run of the call). cuBLAS's split-K partials for the decode step's fc2 and attention output
# projection (`decode_gemm.splitk_cublas`, reduced inside the add + RMSNorm kernel) against cuBLAS's whole-K
# GEMM then the add + RMSNorm at the 0.5B shape (`bench_decode_gemm.py --cublas-only`, which writes the table
# of the settings that won by >= 3%); then the 0.5B fixed step as A B B A: A with that table in force
# (MEGATRON_RL_DECODE_GEMM_TABLE) and the detokenising child process (MEGATRON_RL_DETOKENIZE_PROCESS=1), B
# with neither. Decode ms a step tells the table's effect (the child process does not touch generation); the
# update's time (with the scoring inside it) the child's. ~480-560 s on a fresh machine.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cD; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 110 python3 benchmarks/bench_decode_gemm.py --shape qwen2.5-0.5b --parts fc2,proj --rows 128,256,384,512 \
  --cublas-only --out "$O/gemm_05b.json" --table "$O/table_05b.json" > "$O/gemm_05b.log" 2>&1; echo "0.5B rc=$? $((SECONDS - T0))s"
grep "rows" "$O/gemm_05b.log" | cut -c1-170
python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$O/table_05b.json"
source $D/steps.sh; FA=0
MEGATRON_RL_DECODE_GEMM_TABLE=$O/table_05b.json MEGATRON_RL_DETOKENIZE_PROCESS=1 run_step 130 fixed_on $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DETOKENIZE_PROCESS=0 run_step 95 fixed_off $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DETOKENIZE_PROCESS=0 run_step 95 fixed_off2 $FA --steps 4 --shape qwen2.5-0.5b
MEGATRON_RL_DECODE_GEMM_TABLE=$O/table_05b.json MEGATRON_RL_DETOKENIZE_PROCESS=1 run_step 95 fixed_on2 $FA --steps 4 --shape qwen2.5-0.5b
summary fixed_on fixed_off fixed_off2 fixed_on2
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_on", "fixed_off", "fixed_off2", "fixed_on2"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, "decode ms", [round(s["decode"]["ms_per_decode_step"], 4) for s in d["steps"]],
              "reward s", [round(s["timing_s"].get("reward", 0), 4) for s in d["steps"]])
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
PY
grep -h "failed its trial\|failed; it runs\|detokenising process\|Error\|decode GEMM" "$O"/*.log | sort | uniq -c | head -8
tar czf "$OUT/cD_logs.tgz" -C "$O" $(cd "$O" && ls *.log); rm -f "$O"/*.log
