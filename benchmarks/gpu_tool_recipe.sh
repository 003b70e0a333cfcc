#!/usr/bin/env bash
# Issue 17: the `experiment=gsm8k_tool_grpo` recipe (GRPO, multi-turn, calculator tool) for a few steps at
# the Qwen2.5-0.5B shape on one H200: random bf16 weights, synthetic GSM8K-format data and tokenizer
# (make_synthetic_gsm8k.py). A random model never writes a tool call, so the tool file
# benchmarks/tool_recipe_calls.py makes every stopped turn call `calculate`, and a band of token ids
# (STOP_FIRST..STOP_LAST) ends turns about every 150 tokens; episodes run up to the recipe's 4 turns.
# Writes $OUT/tool_recipe_metrics.jsonl (every step's metrics), $OUT/tool_recipe.json (step time and
# tool/calls, tool/errors, tool/timeouts, multi_turn/turns/mean per step) and $OUT/tool_recipe.log.
# Knobs: STEPS (3; the first is warm-up), BATCH (128 prompts x rollout.n=5), BUDGET_S (220).
#   GPU: OUT=/tmp/out bash benchmarks/gpu_tool_recipe.sh            (~4 min on one H200)
#   CPU smoke: TINY=1 bash benchmarks/gpu_tool_recipe.sh            (tiny shape, 2 steps, ~1-2 min)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/tool_recipe}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:-}:$PWD
PY=${PYTHON:-python3}
SHAPE=qwen2.5-0.5b; STEPS=${STEPS:-3}; BATCH=${BATCH:-128}; BUDGET_S=${BUDGET_S:-220}
STOP_FIRST=200; STOP_LAST=1199; RUN=/tmp/tool_recipe_run
X=(rollout.max_new_tokens=1024)
if [[ ${TINY:-0} == 1 ]]; then  # CPU smoke: the tiny shape (vocab 1000), same code paths
  SHAPE=tiny; STEPS=2; BATCH=4; STOP_LAST=299
  X=(rollout.max_new_tokens=64 rollout.n=2 data.max_prompt_length=256 actor.ppo_mini_batch_size=4
     actor.ppo_micro_batch_size_per_gpu=4 trainer.gpu_memory_gb=139.8)
fi
MODEL=/tmp/tool_recipe_${SHAPE//[.-]/_}; DATA=$MODEL/data
LOG="$OUT/tool_recipe.log"; : > "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$LOG"
$PY - "$MODEL" "$SHAPE" <<'PYEOF' 2>&1 | tee -a "$LOG"
import sys
sys.path.insert(0, "benchmarks")
from bench_rl_step import prepare
prepare(sys.argv[1], sys.argv[1] + "/bench_data", sys.argv[2], 8, 16)  # the random model + its tokenizer
PYEOF
VOCAB=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL/config.json")
$PY benchmarks/make_synthetic_gsm8k.py --model-dir "$MODEL" --data-dir "$DATA" --vocab-size "$VOCAB" | tee -a "$LOG"
STOPS=$(seq -s, "$STOP_FIRST" "$STOP_LAST")
rm -rf "$RUN"
START=$(date +%s)
CMD=(torchrun --nproc-per-node=1 -m megatron_rl.train experiment=gsm8k_tool_grpo model.path="$MODEL"
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" data.train_batch_size="$BATCH"
  rollout.multi_turn.tool_path=benchmarks/tool_recipe_calls.py rollout.multi_turn.parser=every_turn_calculate
  "rollout.stop_token_ids=[$STOPS]" trainer.output_dir="$RUN" "trainer.logger=[console,jsonl]"
  trainer.total_training_steps="$STEPS" trainer.test_freq=-1 trainer.val_before_train=false
  trainer.save_freq=-1 trainer.save_final=false trainer.save_on_signal=false "${X[@]}")
echo "== ${CMD[*]:0:20} ... (stop ids $STOP_FIRST..$STOP_LAST)" | tee -a "$LOG"
timeout "$BUDGET_S" "${CMD[@]}" 2>&1 | grep -v -i -E 'warn|^\s*$' | tee -a "$LOG" | tail -n 15
RC=${PIPESTATUS[0]}
echo "== rc $RC in $(($(date +%s) - START)) s" | tee -a "$LOG"
cp "$RUN/metrics.jsonl" "$OUT/tool_recipe_metrics.jsonl" 2>/dev/null
cp "$RUN"/error_rank0.log "$OUT/" 2>/dev/null
$PY - "$OUT" "$SHAPE" "$BATCH" "$RC" <<'PYEOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
out, shape, batch, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
path = Path(out) / "tool_recipe_metrics.jsonl"
rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
keys = ["timing_s/step", "timing_s/gen", "timing_s/update_actor", "tool/calls", "tool/errors",
        "tool/timeouts", "multi_turn/turns/mean", "response_length/mean", "rollout/logprob_abs_diff"]
steps = [{"step": r["step"], **{k: r.get(k) for k in keys}} for r in rows if "timing_s/step" in r]
timed = [s["timing_s/step"] for s in steps[1:]] or [s["timing_s/step"] for s in steps]
summary = {"recipe": "experiment=gsm8k_tool_grpo", "shape": shape, "prompts": batch, "rc": rc,
           "step_time_s_after_warmup": sum(timed) / len(timed) if timed else None, "steps": steps}
(Path(out) / "tool_recipe.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PYEOF
