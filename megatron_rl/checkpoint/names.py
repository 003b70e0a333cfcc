"""Every file and directory name of the checkpoints this package writes and reads, defined once.

Trainer checkpoints, under ``<trainer.output_dir>/checkpoints/``::

    latest_checkpointed_iteration.txt    N of the newest complete checkpoint (written last)
    global_step_<N>/
        dist/                             megatron-core torch_dist: actor/critic weights + optimizer states
        rng/rank_<R>.pt                   per-rank RNG states (python, numpy, torch, CUDA, TP tracker)
        state.json                        step, data position, KL controller, LR schedulers, layout, config
        hf/                               optional HF export of the actor (trainer.save_hf)
        hf_config/                        the actor's HF config.json + tokenizer
        megatron_rl_model.json            ModelArgs, TP/PP and role, so a reader needs no --hf-config
        complete.json                     manifest {file: size, digest}, written last inside the directory
    .tmp_global_step_<N>/                 a write in progress (renamed to global_step_<N> when done)

Converter checkpoints (``checkpoints_tools/hf_to_megatron.py``)::

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000001/                  torch_dist files, or mp_rank_XX[_YYY]/model_optim_rng.pt
    <root>/megatron_rl_model.json
    <root>/hf/                            the HF config.json and tokenizer files

``<trainer.output_dir>/.megatron_rl.lock`` marks the run that owns an output directory.
"""

from __future__ import annotations

import re

CKPT_DIR = "checkpoints"
POINTER = "latest_checkpointed_iteration.txt"
MANIFEST = "complete.json"
STATE = "state.json"
DIST = "dist"
RNG = "rng"
HF = "hf"
MODEL_SIDE = "hf_config"
META_FILE = "megatron_rl_model.json"
TMP_PREFIX = ".tmp_"
LEGACY_FILE = "model_optim_rng.pt"
TORCH_DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's pickled metadata
MCORE_METADATA = "metadata.json"  # megatron-core's marker of a torch_dist directory
LOCK_FILE = ".megatron_rl.lock"

STEP_DIR = re.compile(r"^global_step_(\d+)$")
LEGACY_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")
DIST_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # written by the global rank in the name
RNG_SHARD = re.compile(r"^rank_(\d+)\.pt$")


def step_dir_name(step: int) -> str:
    return f"global_step_{step}"


def rng_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def legacy_rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_XX`` (TP rank) with ``_YYY`` (PP rank) only when PP > 1, as Megatron-LM names them."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
