#!/usr/bin/env bash
# Session 41, call D (carry `.whl`; any H100 / H200; ~100 s): the 0.5B fixed step with the collector fixed
# (trainer.gc_freeze=true, the default: setup and the first step frozen) and with trainer.gc_freeze=false (what
# every device run before this fix did, since the freeze was skipped there). 4 steps each, one process each.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cD; mkdir -p "$O"; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
source $D/steps.sh
run_step 100 a_frozen 0 --steps 4 --shape qwen2.5-0.5b
K+=(trainer.gc_freeze=false)  # an override after K's (argparse takes the overrides as one trailing list)
run_step 100 b_unfrozen 0 --steps 4 --shape qwen2.5-0.5b
python3 - "$O" <<'PY'
import json, sys
for f in ("a_frozen", "b_unfrozen"):
    d = json.load(open(f"{sys.argv[1]}/{f}.json"))
    print(f, "settle", d.get("collector_settle"))
    for r in d["steps"]:
        t, tl = r["timing_s"], r["host_timeline"]
        gcs = {}
        for n, a, b in tl["spans_ms"]:
            if n.startswith("gc"):
                gcs[n] = gcs.get(n, 0) + b - a
        gcs = {n: round(v, 2) for n, v in gcs.items()}  # rounded once (the run's own printout rounded each span)
        print(f, r["step"], round(r["step_s"], 4), "gen", round(t["gen"], 4), "upd", round(t["update_actor"], 4),
              "gc_ms", gcs, "x_roof", round(r["step_over_roofline_this_gpu"], 4), "tracked",
              tl["collector_after"]["tracked"])
PY
