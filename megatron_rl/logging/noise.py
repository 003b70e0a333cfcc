"""What a normal run prints: the progress bar, metrics and our own messages. Dependencies' INFO logs,
FutureWarnings, progress bars and start-up warnings go behind ``MEGATRON_RL_VERBOSE=1``."""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "MEGATRON_RL_VERBOSE"
QUIET_LOGGERS = ("megatron", "torch.distributed", "transformers", "matplotlib", "urllib3", "mlflow", "git")
QUIET_MESSAGES = (
    ".*CUDA_DEVICE_MAX_CONNECTIONS.*",  # megatron-core's advice for overlapped TP comms, not used here
    ".*Transformer Engine and Apex are not installed.*",
    ".*Apex is not installed.*",
)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_dependencies() -> None:
    """Silence the dependencies' chatter unless ``MEGATRON_RL_VERBOSE=1``; call before importing them."""
    if verbose():
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in QUIET_MESSAGES:
        warnings.filterwarnings("ignore", message=message)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("default", category=FutureWarning, module="megatron_rl")  # ours stay visible
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Writing model shards" bars
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # child processes (checkpoint writers)
