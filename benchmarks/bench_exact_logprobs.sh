#!/usr/bin/env bash
# Issue 18: rollout.exact_logprobs off, then on, in one run on one GPU: bench_rl_step.py's GRPO workload
# (Qwen2.5-0.5B shape, random bf16 weights, 64 prompts x 8, 256 + 512 tokens, 3 steps, the first warm-up)
# with the same keys run_sizes.sh uses, then $OUT/exact_logprobs.{json,md}: per mode the fraction of
# response tokens whose rollout and training log-probs differ (rollout/logprob_mismatch_frac, every step),
# the mean |gap| (rollout/logprob_abs_diff), the median step time and decode tokens/s, and the on/off ratios
# against the targets (0 mismatching tokens; step <= 1.15x, decode <= 1.25x).
#   GPU (at most 5.6 min: two parts of <= 165 s each): bash benchmarks/bench_exact_logprobs.sh
#   CPU smoke:         TINY=1 bash benchmarks/bench_exact_logprobs.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export PYTHONPATH=${PYTHONPATH:-}:$PWD
W=(--shape qwen2.5-0.5b --steps "${STEPS:-3}"); X=()
if [[ ${TINY:-0} == 1 ]]; then
  W=(--shape tiny --steps 2 --prompts 4 --n 2 --prompt-len 16 --response-len 8 --micro 4)
  X=(trainer.gpu_memory_gb=139.8)
fi
LOG="$OUT/exact_logprobs.log"; : > "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$LOG"
for mode in ${MODES:-false true}; do  # MODES=true re-runs one mode (the other json kept in $OUT)
  echo "== rollout.exact_logprobs=$mode" | tee -a "$LOG"
  timeout "${CAP_S:-165}" python3 benchmarks/bench_rl_step.py "${W[@]}" --out "$OUT/exact_$mode.json" \
    actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=${BUDGET:-auto} rollout.max_num_seqs=auto \
    "rollout.exact_logprobs=$mode" "${X[@]}" 2>&1 | grep -v -i -E 'warn|^\s*$' | tee -a "$LOG" | tail -n 4
  echo "== rc ${PIPESTATUS[0]}" | tee -a "$LOG"
done
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, platform, sys, time
from pathlib import Path

out = Path(sys.argv[1])
runs = {m: json.loads((out / f"exact_{m}.json").read_text()) for m in ("false", "true") if (out / f"exact_{m}.json").exists()}
rows = {}
for mode, r in runs.items():
    med = r["median_after_warmup"]
    steps = r["steps"]
    rows[mode] = {
        "mismatch_frac_per_step": [s.get("rollout_logprob_mismatch_frac") for s in steps],
        "abs_diff_per_step": [s.get("rollout_logprob_abs_diff") for s in steps],
        "step_s": med["step_s"],
        "decode_tok_per_s": med["decode_tok_per_s"],
        "timing_s": med["timing_s"],
    }
summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
           "command": "bash benchmarks/bench_exact_logprobs.sh", "modes": rows}
try:
    import torch, triton
    summary |= {"torch": torch.__version__, "triton": triton.__version__,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
except ImportError:
    pass
if len(rows) == 2:
    off, on = rows["false"], rows["true"]
    summary["step_ratio_on_over_off"] = on["step_s"] / off["step_s"]
    summary["decode_ratio_off_over_on"] = off["decode_tok_per_s"] / on["decode_tok_per_s"]
    summary["targets_met"] = {
        "zero_mismatch_with_mode_on": all(f == 0 for f in on["mismatch_frac_per_step"]),
        "step_within_1.15x": summary["step_ratio_on_over_off"] <= 1.15,
        "decode_within_1.25x": summary["decode_ratio_off_over_on"] <= 1.25,
    }
(out / "exact_logprobs.json").write_text(json.dumps(summary, indent=1))
md = ["| exact_logprobs | mismatch frac (per step) | abs diff (per step) | step s | decode tok/s |", "| --- | --- | --- | --- | --- |"]
for mode, r in rows.items():
    fmt = lambda xs: ", ".join("-" if x is None else f"{x:.3g}" for x in xs)
    md.append(f"| {mode} | {fmt(r['mismatch_frac_per_step'])} | {fmt(r['abs_diff_per_step'])} | {r['step_s']:.2f} | {r['decode_tok_per_s']:.0f} |")
for k in ("step_ratio_on_over_off", "decode_ratio_off_over_on", "targets_met"):
    if k in summary:
        md.append(f"\n{k}: {summary[k]}")
(out / "exact_logprobs.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PY
