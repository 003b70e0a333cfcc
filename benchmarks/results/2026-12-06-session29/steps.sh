# Sourced: `run_step LIMIT NAME FA4(0/1) ARGS...` runs benchmarks/bench_rl_step.py into $O/NAME.json with
# MEGATRON_RL_FA4 set, unless it would pass the call's time guard; `summary NAMES...` prints each JSON's
# step, update and decode figures and the attention kernel the run used.
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
run_step() { local lim=$1 name=$2 fa4=$3; shift 3
  if (( SECONDS - T0 + lim > ${GUARD:-570} )); then echo "$name skipped (time)"; return; fi
  MEGATRON_RL_FA4=$fa4 timeout "$lim" python3 benchmarks/bench_rl_step.py "$@" --out "$O/$name.json" "${K[@]}" \
    > "$O/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - T0))s"; }
summary() { python3 - "$O" "$@" <<'PY'
import json, sys
O = sys.argv[1]
for f in sys.argv[2:]:
    try:
        d = json.load(open(f"{O}/{f}.json")); r = d["median_after_warmup"]
        print(f, d.get("packed_attention_kernel"), json.dumps({k: r.get(k) for k in (
            "step_s", "step_over_roofline", "step_over_roofline_this_gpu", "step_over_roofline_measured_rates",
            "decode_fraction_of_hbm_floor_this_gpu")}),
              "step", [round(s["step_s"], 3) for s in d["steps"]],
              "update", [round(s["timing_s"]["update_actor"], 3) for s in d["steps"]],
              "gen", [round(s["timing_s"]["gen"], 3) for s in d["steps"]])
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable", e)
PY
}
