#!/usr/bin/env bash
# Issue 8: the whole performance table in one command, on one H200 (NGPU=2: the two-GPU variant of the
# end-to-end step; the other parts stay on one GPU).
#   1. end-to-end GRPO step, ours (bench_rl_step.py) vs TRL GRPOTrainer use_vllm=False (bench_trl_grpo.py)
#   2. actor update MFU, ours vs a plain HF forward/backward/AdamW loop (bench_update_mfu.py)
#   3. peak memory per phase, PPO with actor + critic + reference on one GPU (bench_rl_step.py --algo ppo)
#   4. decode: the engine vs HF generate (bench_decode.py, called as is)
# then one JSON and one Markdown table: $OUT/<date>-<gpu>.json and .md (OUT defaults to benchmarks/results).
#
# TRL and datasets are not on the GPU box: install the carried wheels first (see benchmarks/README.md):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/run_all.sh
# BUDGET_S (default 570) bounds the whole run: each part gets a timeout from what is left, most important
# first, and the summary is written from whatever finished. STEPS / TRL_STEPS: steps per RL run (first = warm-up).
# Batching: GRPO actor micro-batches by a token budget of GRPO_TOKENS (24576 = 32 x 768); the update-MFU
# part's ours by MFU_TOKENS (16384 = 16 x 1024; the HF loop keeps 8 x 1024); PPO memory at PPO_MICRO=8.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
NGPU=${NGPU:-1}; STEPS=${STEPS:-3}; TRL_STEPS=${TRL_STEPS:-3}; BUDGET_S=${BUDGET_S:-570}
LOG="$OUT/run_all.log"
source benchmarks/_parts.sh  # environment, deadline, part()
G=() T=() M=() P=() D=()
if [[ ${TINY:-0} == 1 ]]; then  # CPU smoke of this script: tiny model and sizes, same code paths
  G=(--tiny --prompts 4 --n 2 --prompt-len 16 --response-len 8 --micro 4)
  T=("${G[@]}"); P=(--tiny --prompts 8 --prompt-len 16 --response-len 8 --micro 4)
  M=(--tiny --seq-len 64 --prompt-len 16 --micro 2 --mini 4 --iters 2 --warmup 1)
  D=(--device cpu --layers 2 --prompts 4 --prompt-len 8 --new-tokens 4)
fi
if ((NGPU > 1)); then
  OURS=(torchrun --nproc-per-node="$NGPU"); TRL=(accelerate launch --num_processes "$NGPU")
else
  OURS=(python3); TRL=(python3)
fi
python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.metadata as m
for p in ["torch", "transformers", "megatron-core", "trl", "datasets", "accelerate", "pyarrow", "fsspec", "dill", "multiprocess"]:
    try:
        print(p, m.version(p))
    except Exception:
        print(p, "MISSING")
EOF

part grpo_ours 200 "${OURS[@]}" benchmarks/bench_rl_step.py --algo grpo --steps "$STEPS" "${G[@]}" --out "$OUT/rl_grpo.json" \
  actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu="${GRPO_TOKENS:-24576}"
part grpo_trl 240 "${TRL[@]}" benchmarks/bench_trl_grpo.py --steps "$TRL_STEPS" "${T[@]}" --out "$OUT/trl_grpo.json"
part update_mfu 150 python3 benchmarks/bench_update_mfu.py --dynamic-tokens "${MFU_TOKENS:-16384}" "${M[@]}" \
  --out "$OUT/update_mfu.json"
part ppo_memory 150 python3 benchmarks/bench_rl_step.py --algo ppo --steps 2 --micro "${PPO_MICRO:-8}" "${P[@]}" \
  --out "$OUT/rl_ppo.json"
part decode 150 python3 benchmarks/bench_decode.py "${D[@]}" --out "$OUT/bench_decode.json"
# issue 16: the spread-length workload (EOS at fixed-seed log-normal lengths, the same for TRL), packed micro-batches
part grpo_spread_ours 200 "${OURS[@]}" benchmarks/bench_rl_step.py --algo grpo --lengths spread --steps "$STEPS" "${G[@]}" \
  --out "$OUT/rl_grpo_spread.json" actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu="${GRPO_TOKENS:-24576}" actor.pack_sequences=true
part grpo_spread_trl 200 "${TRL[@]}" benchmarks/bench_trl_grpo.py --lengths spread --steps "$TRL_STEPS" "${T[@]}" --out "$OUT/trl_grpo_spread.json"

export RUN_ALL_COMMAND="NGPU=$NGPU STEPS=$STEPS TRL_STEPS=$TRL_STEPS BUDGET_S=$BUDGET_S bash benchmarks/run_all.sh"
python3 - "$OUT" "$NGPU" <<'EOF' 2>&1 | tee -a "$LOG"
import datetime, importlib.metadata as m, json, os, subprocess, sys
out, ngpu = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
def ver(p):
    try:
        return m.version(p)
    except Exception:
        return None
import torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
tag = {"NVIDIA H200": "h200"}.get(gpu, gpu.lower().replace(" ", "-")) + (f"x{ngpu}" if ngpu > 1 else "")
date = datetime.date.today().isoformat()
ours, trl, ppo, mfu, dec = (load(f) for f in ("rl_grpo.json", "trl_grpo.json", "rl_ppo.json", "update_mfu.json", "bench_decode.json"))
rows, summary = [], {}
def row(metric, o, b, target, met, note=""):
    rows.append(f"| {metric} | {o} | {b} | {target} | {met} | {note} |")
if ours and trl:
    o, t = ours["median_after_warmup"], trl["median_after_warmup"]
    x = o["tok_per_s_per_gpu"] / t["tok_per_s_per_gpu"]
    summary["grpo_speedup_vs_trl"] = x
    row("GRPO step, tok/s/GPU (s/step)", f"{o['tok_per_s_per_gpu']:.0f} ({o['step_s']:.2f} s)",
        f"TRL {t['tok_per_s_per_gpu']:.0f} ({t['step_s']:.2f} s)", ">= 3x TRL",
        "yes" if x >= 3 else f"no: {x:.2f}x, {x / 3:.0%} of target", f"{x:.2f}x")
    row("GRPO phases, s", ", ".join(f"{k} {v:.2f}" for k, v in o["timing_s"].items()),
        ", ".join(f"{k} {v:.2f}" for k, v in t["timing_s"].items()), "", "", "")
elif ours:
    o = ours["median_after_warmup"]
    row("GRPO step, tok/s/GPU (s/step)", f"{o['tok_per_s_per_gpu']:.0f} ({o['step_s']:.2f} s)", "TRL: no result",
        ">= 3x TRL (~72k)", "yes" if o["tok_per_s_per_gpu"] >= 72000 else f"no: {o['tok_per_s_per_gpu'] / 72000:.0%} of 72k", "")
spread, spread_trl = load("rl_grpo_spread.json"), load("trl_grpo_spread.json")
if spread:
    o = spread["median_after_warmup"]
    x = spread_trl["median_after_warmup"]["step_s"] / o["step_s"] if spread_trl else None
    row("GRPO step, spread lengths (packed), s", f"{o['step_s']:.2f} (pad {o['update_pad_frac']:.3f})",
        f"TRL {spread_trl['median_after_warmup']['step_s']:.2f}" if spread_trl else "TRL: no result", "",
        "", f"{x:.2f}x TRL, {o['step_over_roofline']:.2f}x roofline" if x else f"{o['step_over_roofline']:.2f}x roofline")
if ours:
    row("actor update MFU inside the GRPO step", f"{ours['median_after_warmup']['actor_update_mfu']:.3f}", "", ">= 0.45", "", "")
if mfu:
    r = mfu["results"]; best = r.get("ours", r["ours_one_micro_per_step"])
    row(f"actor update MFU, {mfu['config']['micro']} x {mfu['config']['seq_len']} micro-batches",
        ", ".join(f"{k} {v['mfu']:.3f}" for k, v in r.items() if k != "hf_plain"), f"HF loop {r['hf_plain']['mfu']:.3f}",
        ">= 0.45", "yes" if best["mfu"] >= 0.45 else f"no: {best['mfu'] / 0.45:.0%} of target",
        f"{best['mfu'] / r['hf_plain']['mfu']:.2f}x HF")
if ppo and "peak_allocated_gib" in ppo:
    peak_gb = ppo["peak_allocated_gib"] * 2**30 / 1e9
    row("PPO colocated peak memory, GB (allocated)",
        ", ".join(f"{k} {v * 2**30 / 1e9:.1f}" for k, v in ppo["peak_allocated_gib_by_phase"].items()),
        "verl 43.5 (reported)", "<= 30", "yes" if peak_gb <= 30 else f"no: {peak_gb - 30:.1f} GB over", f"max {peak_gb:.1f}")
if dec:
    for k, v in dec["ours"].items():
        row(f"decode ({k}), new tok/s", f"{v['new_tok_per_s']:.0f}, {v['ms_per_decode_step']:.2f} ms/step",
            f"HF generate {dec['hf_generate']['new_tok_per_s']:.0f}", "", "",
            f"{dec['speedup_new_tok_per_s'][k]:.2f}x HF, {v['fraction_of_hbm_floor']:.1%} of HBM floor")
versions = {p: ver(p) for p in ("torch", "transformers", "megatron-core", "trl", "datasets", "accelerate")}
result = {"date": date, "gpu": gpu, "ngpu": ngpu, "versions": versions,
          "command": os.environ["RUN_ALL_COMMAND"], "git_commit": os.environ.get("GIT_COMMIT"),
          "summary": summary, "grpo_ours": ours, "grpo_trl": trl, "update_mfu": mfu, "ppo_memory": ppo, "decode": dec}
result |= {"grpo_spread_ours": spread, "grpo_spread_trl": spread_trl}
json.dump(result, open(os.path.join(out, f"{date}-{tag}.json"), "w"), indent=2)
table = [f"{gpu} x{ngpu}, {date}; " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
         "| metric | ours | baseline | target | met | ratio |", "| --- | --- | --- | --- | --- | --- |", *rows]
open(os.path.join(out, f"{date}-{tag}.md"), "w").write("\n".join(table) + "\n")
print("\n".join(table))
EOF
