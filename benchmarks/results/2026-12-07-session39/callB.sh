#!/usr/bin/env bash
# Session 39, call B (carry `.whl` and `.old`; H200 only unless ANY=1): issue 16's targets at this tree (0.5B
# fixed 5 steps, 3B fixed, 0.5B spread 5 steps) with bench_rl_step.py's host timeline, and the 0.5B fixed step
# at dd5f26c (the session's start) after the first; 3B if the time is left. `.old` must be a whole tree:
#   rm -rf .old && mkdir -p .old/benchmarks && git archive dd5f26c megatron_rl configs | tar -x -C .old && cp benchmarks/*.py .old/benchmarks/
# (bench_rl_step.py puts its own repo first on sys.path: as run in session 39, with PYTHONPATH=.old and this
# tree's script, "d_fixed_old" ran this tree's package; its JSON's "package" now says which ran).
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cB; mkdir -p "$O"; T0=$SECONDS
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" != *H200* && -z "${ANY:-}" ]]; then echo "not an H200: stopping"; exit 3; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
source $D/steps.sh
run_step 120 a_fixed 0 --steps 5 --shape qwen2.5-0.5b
(cd .old && PYTHONPATH=/tmp/site run_step 110 d_fixed_old 0 --steps 5 --shape qwen2.5-0.5b)
run_step 110 c_spread 0 --steps 5 --shape qwen2.5-0.5b --lengths spread
run_step 250 b_fixed_3b 0 --steps 3 --shape qwen2.5-3b
summary a_fixed b_fixed_3b c_spread d_fixed_old
python3 - "$O" <<'PY'
import json, sys
for f in ("a_fixed", "b_fixed_3b", "c_spread", "d_fixed_old"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{f}.json"))
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e); continue
    for r in d["steps"]:
        t, tl = r["timing_s"], r["host_timeline"]
        sp = {}
        for n, a, b in tl["spans_ms"]:
            sp.setdefault(n, (a, b))
        split = sp.get("actor_split", (0, 0))
        print(f, r["step"], round(r["step_s"], 3), "gen", round(t["gen"], 3), "upd", round(t["update_actor"], 3),
              "outside_ms", round((r["step_s"] - t["gen"] - t["update_actor"]) * 1e3, 1),
              "build_ms", round(sp["build_batch"][1] - sp["build_batch"][0], 1),
              "rollout_tail_ms", round(sp["rollout"][1] - sp["build_batch"][1], 1),
              "split_ms", round(split[1] - split[0], 1),
              "decode_ms", round(r["decode"]["ms_per_decode_step"], 3), tl.get("allocator_calls"))
PY
