#!/usr/bin/env bash
# One node: NPROC processes (default: one per visible GPU, or 1 without GPUs) running
# `python -m megatron_rl.train`; every argument is passed through as a Hydra override.
#   NPROC=8 launch/torchrun.sh model=qwen2_5_0_5b model.path=/models/Qwen2.5-0.5B-Instruct algorithm=grpo
# LAUNCH_DRY=1 prints the command instead of running it.
set -euo pipefail

# The project's venv when there is one (the README's set-up makes .venv): no activation needed.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "${repo}/.venv/bin/python" ]]; then PYTHON="${repo}/.venv/bin/python"; else PYTHON=python3; fi
fi

if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "${NPROC}" -ge 1 ]] || NPROC=1
fi
# After forwarding SIGTERM/SIGINT, torchrun SIGKILLs the workers after this many seconds (its default, 30, is
# too short for a step and a checkpoint write; the trainer stops cleanly on the signal)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"
cmd=("${PYTHON}" -m torch.distributed.run --standalone --nnodes=1 "--nproc-per-node=${NPROC}"
     -m megatron_rl.train "$@")
if [[ "${LAUNCH_DRY:-0}" == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
