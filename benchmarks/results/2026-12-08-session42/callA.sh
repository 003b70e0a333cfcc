#!/usr/bin/env bash
# Session 42, call A (carry `.whl`; H200 only unless ANY=1): issue 16's step targets at this tree with the
# collector's freeze working (session 41's fix): the 0.5B fixed step twice, the 0.5B spread step, the 3B
# fixed step. Session 41's call A compared session 40's tree (before session 41's collector fix) with dd5f26c
# on an H100 (0.1-1.2% faster), so no old tree runs here. Each JSON's "collector_settle" says what the freeze held.
set -u
D=benchmarks/results/2026-12-06-session29; O=$OUT/cA; mkdir -p "$O"; T0=$SECONDS
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if [[ "$GPU" != *H200* && -z "${ANY:-}" ]]; then echo "not an H200: stopping"; exit 3; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
source $D/steps.sh
run_step 110 a_fixed 0 --steps 5 --shape qwen2.5-0.5b
run_step 100 b_spread 0 --steps 5 --shape qwen2.5-0.5b --lengths spread
run_step 200 c_fixed_3b 0 --steps 3 --shape qwen2.5-3b
run_step 100 d_fixed 0 --steps 5 --shape qwen2.5-0.5b
summary a_fixed b_spread c_fixed_3b d_fixed
python3 - "$O" <<'PY'
import json, sys
for f in ("a_fixed", "b_spread", "c_fixed_3b", "d_fixed"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{f}.json"))
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e); continue
    cs = d.get("collector_settle") or {}
    print(f, "package", d.get("package"), "settle_before", json.dumps(cs.get("before")), "settle_after",
          json.dumps(cs.get("after")))
    for r in d["steps"]:
        t, tl = r["timing_s"], r["host_timeline"]
        gc2 = sum(b - a for n, a, b in tl["spans_ms"] if n == "gc2")
        full = [[round(x[1] - x[0], 1), x[2]] for x in tl.get("full_collections") or []]
        print(f, r["step"], round(r["step_s"], 3), "gen", round(t["gen"], 3), "upd", round(t["update_actor"], 3),
              "outside_ms", round((r["step_s"] - t["gen"] - t["update_actor"]) * 1e3, 1), "gc2_ms", round(gc2, 1),
              "full_gc_ms", full, "x_roof", round(r["step_over_roofline_this_gpu"], 4),
              "decode_ms", round(r["decode"]["ms_per_decode_step"], 3),
              "decode_frac", round(r["decode"]["fraction_of_hbm_floor_this_gpu"], 4), "pad", r.get("update_pad_frac"))
PY
echo "total $((SECONDS - T0)) s"
