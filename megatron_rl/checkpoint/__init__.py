"""Training checkpoints (megatron-core torch_dist, resharding on load) and resume; HF<->Megatron conversion
lives in ``convert.py``.

    save_checkpoint(components, step)   every rank, after step ``step``'s metrics are logged
    resume(components) -> start_step    every rank, after build; 0 when there is nothing to resume
"""

from megatron_rl.checkpoint.layout import CheckpointError, check_complete, newest_complete, truncate_metrics
from megatron_rl.checkpoint.manager import (
    find_checkpoint,
    load_checkpoint,
    load_model_weights,
    resume,
    save_checkpoint,
    save_hf,
)

__all__ = [
    "CheckpointError",
    "check_complete",
    "find_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "newest_complete",
    "resume",
    "save_checkpoint",
    "save_hf",
    "truncate_metrics",
]
