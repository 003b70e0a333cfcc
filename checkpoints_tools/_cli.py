"""Shared CLI plumbing for the converters: import path, one-paragraph errors, exit codes."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

EXPECTED_ERRORS = (FileNotFoundError, KeyError, ValueError, ImportError)


def run(name: str, fn) -> int:
    """Call ``fn()`` -> report line or None; print it (rank 0) and map expected errors to exit code 2."""
    # megatron-core/torch deprecation chatter would bury the one-line report
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    from megatron_rl.checkpoint.layout import CheckpointError  # unusable or unsafe checkpoints

    try:
        line = fn()
    except (*EXPECTED_ERRORS, CheckpointError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{name}: error: {msg}", file=sys.stderr)
        return 2
    if line:
        print(line, flush=True)
    return 0
