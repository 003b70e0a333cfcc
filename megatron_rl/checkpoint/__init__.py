"""Training checkpoints (megatron-core torch_dist, resharding on load) and resume; HF<->Megatron conversion
lives in ``convert.py``, every file name in ``names.py``.

    Checkpointer(...).resume() -> start_step    every rank, after build; 0 when there is nothing to resume
    Checkpointer(...).maybe_save(step, last)    every rank, after step ``step``'s metrics are logged
"""

from megatron_rl.checkpoint.checkpointer import Checkpointer, ModelSide, TrainedRole
from megatron_rl.checkpoint.convert import load_model_weights
from megatron_rl.checkpoint.layout import (
    CheckpointError,
    check_complete,
    newest_complete,
    resume_candidates,
    truncate_metrics,
)
from megatron_rl.checkpoint.safe_load import UnsafeCheckpointError

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ModelSide",
    "TrainedRole",
    "UnsafeCheckpointError",
    "check_complete",
    "load_model_weights",
    "newest_complete",
    "resume_candidates",
    "truncate_metrics",
]
