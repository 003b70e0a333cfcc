#!/usr/bin/env bash
# Session 31, call 2 (within 30 s of session 29's call1.sh, which carries `.fa4a`, on the same held machine).
# Carry `.whl`, `.fa4b` (without its cuda-bindings wheels `cb/`: the device has them) and, for the A/B, `.old`
# (an older tree from `git archive`, see the README). NO_FA4=1: one call without call1.sh and FA4.
# On an H200: issue 16's targets with FlashAttention-4 (session 27's callX.sh: 0.5B fixed and spread, 3B
# spread and fixed, one profiled 0.5B fixed step). On an H100: the shared-prompt gather's backward alone
# (bench_update_kernels.py --cases gather), the 0.5B fixed step at this tree with FA4 (its
# per-layout trial's first GPU run: `packed_attention_fa4_layouts` in the JSON), the same at `.old` if carried
# (AB=1: this tree, old, old, this: the second run of a pair is ~2% faster), one profiled 0.5B fixed step at
# this tree (its kernel table: the gather, RoPE, bias kernels), then the 0.5B spread step (7 steps) if time is left.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/c2; mkdir -p "$O"; T0=$SECONDS
if [ -n "${NO_FA4:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD; FA=0
else source $D/fa4_env.sh; FA=1; fi
source $D/steps.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" == *H200* ]]; then
  GUARD=${GUARD:-570} bash benchmarks/results/2026-12-06-session27/callX.sh; rm -rf "$OUT/cX" "$O"; exit; fi
old() { local name=$1; shift
  if [ ! -d .old ] || (( SECONDS - T0 + 130 > ${GUARD:-570} )); then echo "$name skipped"; return; fi
  PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.old MEGATRON_RL_FA4=$FA timeout 130 \
    bash -c 'cd .old && python3 benchmarks/bench_rl_step.py "$@"' _ "$@" --out "$O/$name.json" "${K[@]}" \
    > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
timeout 60 python3 benchmarks/bench_update_kernels.py --cases gather --out "$O/update_kernels.json" \
  > "$O/update_kernels.log" 2>&1; echo "update_kernels rc=$? $((SECONDS - T0))s"; tail -2 "$O/update_kernels.log"
run_step 130 fixed_new $FA --steps 4 --shape qwen2.5-0.5b
if [ -n "${AB:-}" ]; then
  old fixed_old --steps 4 --shape qwen2.5-0.5b
  old fixed_old2 --steps 4 --shape qwen2.5-0.5b
  run_step 130 fixed_new2 $FA --steps 4 --shape qwen2.5-0.5b
fi
run_step 120 fixed_prof $FA --steps 2 --shape qwen2.5-0.5b --profile "$O/prof_fixed"
run_step 120 spread_new $FA --steps 7 --shape qwen2.5-0.5b --lengths spread
summary fixed_new fixed_old fixed_old2 fixed_new2 fixed_prof spread_new
python3 - "$O" <<'PY'
import json, sys
O = sys.argv[1]
for f in ("fixed_new", "fixed_old", "fixed_old2", "fixed_new2", "spread_new"):
    try:
        d = json.load(open(f"{O}/{f}.json"))
        print(f, "fa4 layouts", d.get("packed_attention_fa4_layouts"),
              "decode ms", [round(s["decode"]["ms_per_decode_step"], 3) for s in d["steps"]],
              "step - gen - update", [round(s["step_s"] - s["timing_s"]["gen"] - s["timing_s"]["update_actor"], 4)
                                      for s in d["steps"]])
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
PY
for n in generate update; do
  [ -f "$O/prof_fixed/${n}_ops.txt" ] && grep -E "_segment_sum|index_add|_RopeRows|rope|CompiledFxGraph|aten::add |triton_poi" \
    "$O/prof_fixed/${n}_ops.txt" | head -20 | cut -c1-100,150-260
done
[ -d "$O/prof_fixed" ] && tar czf "$OUT/c2_prof.tgz" -C "$O" prof_fixed && rm -rf "$O/prof_fixed"
grep -h "failed its trial\|failed; it runs eagerly\|Error" "$O"/*.log | sort | uniq -c | head -8
tar czf "$OUT/c2_logs.tgz" -C "$O" $(cd "$O" && ls *.log); rm -f "$O"/*.log
