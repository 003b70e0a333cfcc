"""Collective timeouts as errors that name the phase and the rank, instead of a silent hang.

    with phase("update_actor"):
        ...collectives...

A ``torch.distributed`` timeout inside the block (gloo raises ``RuntimeError: ... timed out``, NCCL with
blocking wait raises ``DistBackendError``) is re-raised as ``CollectiveTimeout`` naming the phase, the
rank and ``trainer.timeout_minutes`` (the process-group timeout set by ``init_distributed``).
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within trainer.timeout_minutes."""


def is_timeout(err: BaseException) -> bool:
    """gloo's and NCCL's timeout errors (``DistBackendError`` is a ``RuntimeError``)."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("timed out" in text or "timeout" in text)


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


@contextlib.contextmanager
def phase(name: str, timeout_minutes: float | None = None):
    """Name what this rank is doing; a collective timeout inside becomes a ``CollectiveTimeout``."""
    try:
        yield
    except CollectiveTimeout:
        raise
    except Exception as err:
        if not is_timeout(err):
            raise
        limit = f"{timeout_minutes:g} min" if timeout_minutes is not None else "the process-group timeout"
        raise CollectiveTimeout(
            f"rank {_rank()}: a collective in phase '{name}' timed out after {limit} (trainer.timeout_minutes). "
            "Another rank did not reach it: look for an earlier error on the other ranks (error_rank<R>.log), "
            "or raise trainer.timeout_minutes if that phase is legitimately slow. Backend said: "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from err
