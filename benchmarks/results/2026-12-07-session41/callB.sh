#!/usr/bin/env bash
# Session 41, call B (carry `.whl`; any H100 / H200): the 3B fixed step, 5 steps, with the bench's collector and
# allocator diagnostics (full collections with what they freed, objects tracked after each step, the
# allocator's calls inside generation apart from the step's): where session 39's and call A's full collection
# in the 3B step comes from. Prints one line a step; the JSON and log under $OUT/cB.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TORCH_LOGS=recompiles  # a recompile in a later step: many new objects
source $D/steps.sh
run_step ${LIM:-300} a_3b 0 --steps ${STEPS:-5} --shape qwen2.5-3b "$@"
python3 - "$O" <<'PY'
import json, sys
d = json.load(open(f"{sys.argv[1]}/a_3b.json"))
print("package", d.get("package"))
for r in d["steps"]:
    t, tl = r["timing_s"], r["host_timeline"]
    print(r["step"], round(r["step_s"], 3), "gen", round(t["gen"], 3), "upd", round(t["update_actor"], 3),
          "full", tl.get("full_collections"), "alloc", tl.get("allocator_calls"), "alloc_gen",
          tl.get("allocator_calls_generate"), "after", tl.get("collector_after"), "freeze",
          tl.get("collector_after_freeze"), "x_roof", round(r["step_over_roofline_this_gpu"], 4))
PY
grep -c "Recompiling" "$O/a_3b.log"; grep -A3 "Recompiling" "$O/a_3b.log" | cut -c1-300 | head -40
