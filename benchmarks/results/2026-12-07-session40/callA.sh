#!/usr/bin/env bash
# Session 40, call A (carry `.whl` and `.old`; H200 only unless ANY=1): the 0.5B fixed step at this tree (new)
# and at dd5f26c (old, session 39's start: session 38's H200 code plus nothing of sessions 39-40) in the order
# new old old new, then the 0.5B spread step and the 3B fixed step at this tree. `.old` must be a whole tree:
#   rm -rf .old && mkdir -p .old && git archive dd5f26c megatron_rl configs | tar -x -C .old \
#     && git archive 00edc3b benchmarks | tar -x -C .old && rm -rf .old/benchmarks/results
# (00edc3b's benchmarks: the host timeline, without this session's second freeze in the bench loop). Each
# JSON's "package" says which tree ran.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cA; mkdir -p "$O"; T0=$SECONDS
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" != *H200* && -z "${ANY:-}" ]]; then echo "not an H200: stopping"; exit 3; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
source $D/steps.sh
run_step 110 a_new 0 --steps 5 --shape qwen2.5-0.5b
(cd .old && PYTHONPATH=/tmp/site run_step 100 b_old 0 --steps 5 --shape qwen2.5-0.5b)
(cd .old && PYTHONPATH=/tmp/site run_step 100 c_old 0 --steps 5 --shape qwen2.5-0.5b)
run_step 100 d_new 0 --steps 5 --shape qwen2.5-0.5b
run_step 100 e_spread 0 --steps 5 --shape qwen2.5-0.5b --lengths spread
run_step 200 f_fixed_3b 0 --steps 3 --shape qwen2.5-3b
summary a_new b_old c_old d_new e_spread f_fixed_3b
python3 - "$O" <<'PY'
import json, sys
for f in ("a_new", "b_old", "c_old", "d_new", "e_spread", "f_fixed_3b"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{f}.json"))
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e); continue
    print(f, "package", d.get("package"))
    for r in d["steps"]:
        t, tl = r["timing_s"], r["host_timeline"]
        sp = {}
        for n, a, b in tl["spans_ms"]:
            sp.setdefault(n, (a, b))
        split = sp.get("actor_split", (0, 0))
        gc2 = sum(b - a for n, a, b in tl["spans_ms"] if n == "gc2")
        print(f, r["step"], round(r["step_s"], 3), "gen", round(t["gen"], 3), "upd", round(t["update_actor"], 3),
              "outside_ms", round((r["step_s"] - t["gen"] - t["update_actor"]) * 1e3, 1),
              "build_ms", round(sp["build_batch"][1] - sp["build_batch"][0], 1),
              "split_ms", round(split[1] - split[0], 1), "gc2_ms", round(gc2, 1),
              "x_roof", round(r["step_over_roofline_this_gpu"], 4),
              "decode_ms", round(r["decode"]["ms_per_decode_step"], 3), tl.get("allocator_calls"))
PY
