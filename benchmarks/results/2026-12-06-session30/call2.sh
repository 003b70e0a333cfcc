#!/usr/bin/env bash
# Session 30, call 2 (within 30 s of session 29's call1.sh, which carries `.fa4a`, on the same held machine).
# Carry `.whl`, `.fa4b` (without its cuda-bindings wheels: the device has them) and `.old` (session 29's last
# commit 87500a0: megatron_rl, configs and the bench scripts, from `git archive`).
# On an H200: issue 16's targets with FlashAttention-4 (session 27's callX.sh). On an H100:
# 1. the update's log-prob kernels: one exp an element (this session) against two and session 29's kernels;
# 2. the 0.5B fixed step at this session's tree, then at session 29's (4 steps each; FA4 on in both; in this
#    order the second run's usual ~2% edge goes to the old tree);
# 3. the profiled 0.5B fixed step at this session's tree (its idle gaps by annotation: retire, split).
# Run 2 also runs session 29's post-review FA4 code (the per-layout trial) on a GPU. ~7.5 min.
# NO_FA4=1: without call1.sh and FA4 (carry `.whl` and `.old` only): the same runs without FA4.
# As run (commit 0b15403): `NO_FA4=1 GUARD=270`; `shared_gather` was a bench_update_kernels.py case then (taken
# out with the fp32 gather); `.old` lacked benchmarks/make_synthetic_gsm8k.py, so run 2's old tree failed and
# call2b.sh ran it.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c2; mkdir -p "$O"; T0=$SECONDS
if [ -n "${NO_FA4:-}" ]; then  # one call, no FA4 (session 29's fa4_env.sh needs call1.sh first)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else source $D/fa4_env.sh; fi
source $D/steps.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" == *H200* ]]; then  # the files come back as cX.tgz (8 files a call)
  GUARD=${GUARD:-570} bash benchmarks/results/2026-12-06-session27/callX.sh; rm -rf "$OUT/cX" "$O"; exit; fi
timeout 150 python3 benchmarks/bench_update_kernels.py --cases logprob,shared_gather --out "$O/update_kernels.json" \
  > "$O/update_kernels.log" 2>&1; echo "update_kernels rc=$? $((SECONDS - T0))s"; tail -2 "$O/update_kernels.log"
run_step 130 fixed_s30 1 --steps 4 --shape qwen2.5-0.5b
(( SECONDS - T0 + 130 <= ${GUARD:-570} )) && PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.old timeout 130 \
  bash -c 'cd .old && python3 benchmarks/bench_rl_step.py "$@"' _ --steps 4 --shape qwen2.5-0.5b \
  --out "$O/fixed_s29.json" "${K[@]}" > "$O/fixed_s29.log" 2>&1; echo "fixed_s29 rc=$? $((SECONDS - T0))s"
run_step 130 fixed_prof 1 --steps 2 --shape qwen2.5-0.5b --profile "$O/prof_fixed"
summary fixed_s29 fixed_s30 fixed_prof
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_s29", "fixed_s30", "fixed_prof"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, "kernel", d.get("packed_attention_kernel"), "fa4 layouts", d.get("packed_attention_fa4_layouts"),
              "step - gen - update", [round(s["step_s"] - s["timing_s"]["gen"] - s["timing_s"]["update_actor"], 4)
                                      for s in d["steps"]])
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
for n in ("generate", "update"):
    try:
        g = json.load(open(f"{O}/prof_fixed/{n}_gaps.json"))
        print(n, "idle us", round(g["idle_us"]), "of", round(g["window_us"]), "by annotation",
              {k: round(v["us"]) for k, v in list(g["by_annotation"].items())[:8]})
    except Exception as e:  # noqa: BLE001
        print(n, "gaps unreadable", e)
PY
tar czf "$OUT/c2_prof.tgz" -C "$O" prof_fixed; rm -rf "$O/prof_fixed"
tar czf "$OUT/c2_logs.tgz" -C "$O" $(cd "$O" && ls *.log); rm -f "$O"/*.log
