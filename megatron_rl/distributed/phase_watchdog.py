"""Collective timeouts as errors that name the phase and the rank, instead of a silent hang.

    with phase("update_actor"):
        ...collectives...

A ``torch.distributed`` timeout inside the block (gloo raises ``RuntimeError: ... timed out``, NCCL with
blocking wait raises ``DistBackendError``) is re-raised as ``CollectiveTimeout`` naming the phase, the
rank and ``trainer.timeout_minutes`` (the process-group timeout set by ``init_distributed``).

NCCL (torch 2.11, checked on 2 x H200 with ``benchmarks/check_nccl_timeout.py``) raises nothing: its
watchdog logs "Watchdog caught collective operation timeout" and the host stays blocked in the next CUDA
sync, with or without ``TORCH_NCCL_BLOCKING_WAIT`` / ``TORCH_NCCL_ASYNC_ERROR_HANDLING``. So on NCCL (or with
``MEGATRON_RL_PHASE_MONITOR=1``) a monitor thread bounds each phase instead: a phase still running after
``timeout_minutes`` writes the named error to stderr and ``error_rank<R>.log`` and ends the process (exit
code 3), so the launcher tears the job down instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

EXIT_STUCK = 3
_POLL_S = float(os.environ.get("MEGATRON_RL_PHASE_POLL_S", "5"))
_state: dict = {"error_dir": None, "current": None, "thread": None}


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


def set_error_dir(path: str | None) -> None:
    """Where the monitor writes ``error_rank<R>.log`` (the trainer's output dir)."""
    _state["error_dir"] = path


def _monitored() -> bool:
    flag = os.environ.get("MEGATRON_RL_PHASE_MONITOR")
    if flag is not None:
        return flag == "1"
    return dist.is_initialized() and dist.get_backend() == "nccl"


def _stuck_message(name: str, minutes: float, rank: int) -> str:
    return (
        f"rank {rank}: phase '{name}' has not finished after {minutes:g} min (trainer.timeout_minutes): a "
        "collective in it is stuck (NCCL logs 'Watchdog caught collective operation timeout' but does not raise). "
        "Another rank did not reach it: look for an earlier error on the other ranks (error_rank<R>.log), or "
        "raise trainer.timeout_minutes if this phase is legitimately slower. Ending this process."
    )


def _monitor() -> None:
    while True:
        time.sleep(_POLL_S)
        current = _state["current"]
        if current is None:
            continue
        name, start, minutes = current
        if time.monotonic() - start <= minutes * 60:
            continue
        message = _stuck_message(name, minutes, _rank())
        print(f"megatron-rl: error: CollectiveTimeout: {message}", file=sys.stderr, flush=True)
        if _state["error_dir"]:
            with contextlib.suppress(OSError):
                log = Path(_state["error_dir"]) / f"error_rank{_rank()}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"CollectiveTimeout: {message}\n")
        os._exit(EXIT_STUCK)


@contextlib.contextmanager
def phase(name: str, timeout_minutes: float | None = None):
    """Name what this rank is doing; a collective timeout inside becomes a ``CollectiveTimeout`` (and on
    NCCL a phase running longer than ``timeout_minutes`` ends the process with that error)."""
    watch = timeout_minutes is not None and _monitored()
    if watch:
        if _state["thread"] is None:
            _state["thread"] = threading.Thread(
                target=_monitor, name="megatron-rl-phase-monitor", daemon=True
            )
            _state["thread"].start()
        outer, _state["current"] = _state["current"], (name, time.monotonic(), timeout_minutes)
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
    finally:
        if watch:
            _state["current"] = outer
