#!/usr/bin/env bash
# The command one slurm task (one per node) runs: torchrun with a c10d rendezvous on the job's first node.
# Reads SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_JOB_ID; GPUS_PER_NODE (default SLURM_GPUS_ON_NODE, else
# the visible GPUs), MASTER_PORT (default 29500). Arguments are Hydra overrides for megatron_rl.train.
#   --dry (first argument) or LAUNCH_DRY=1: print the command instead of running it.
set -euo pipefail

# The project's venv when there is one (the README's set-up makes .venv): no activation needed.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "${repo}/.venv/bin/python" ]]; then PYTHON="${repo}/.venv/bin/python"; else PYTHON=python3; fi
fi

dry="${LAUNCH_DRY:-0}"
if [[ "${1:-}" == "--dry" ]]; then dry=1; shift; fi

for var in SLURM_JOB_NODELIST SLURM_NNODES SLURM_JOB_ID; do
  if [[ -z "${!var:-}" ]]; then
    echo "slurm_cmd.sh: ${var} is not set; run this inside a slurm allocation (launch/slurm.sbatch)" >&2
    exit 2
  fi
done

# First host of a nodelist such as node[003-005,010],gpu7 -> node003 (scontrol when present).
first_host() {
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$1" | head -n1
  elif [[ "$1" =~ ^([^,\[]+)(\[([^]]+)\])? ]]; then
    local prefix="${BASH_REMATCH[1]}" ranges="${BASH_REMATCH[3]}"
    echo "${prefix}${ranges%%[,-]*}"
  else
    echo "slurm_cmd.sh: cannot parse SLURM_JOB_NODELIST=$1" >&2
    return 2
  fi
}

head_node=$(first_host "${SLURM_JOB_NODELIST}")
gpus="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
if [[ -z "${gpus}" ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "${gpus}" -ge 1 ]] || gpus=1
fi

cmd=("${PYTHON}" -m torch.distributed.run
     "--nnodes=${SLURM_NNODES}" "--nproc-per-node=${gpus}"
     --rdzv-backend=c10d "--rdzv-endpoint=${head_node}:${MASTER_PORT:-29500}" "--rdzv-id=${SLURM_JOB_ID}"
     --max-restarts=0
     -m megatron_rl.train "$@")
if [[ "${dry}" == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
