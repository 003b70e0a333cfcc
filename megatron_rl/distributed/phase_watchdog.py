"""Every phase bounded by ``trainer.timeout_minutes``, and timeouts as errors that name the phase and the rank.

    with phase("update_actor", timeout_minutes, what="the actor update"):
        ...work, collectives...

A ``torch.distributed`` timeout inside the block (gloo raises ``RuntimeError: ... timed out``, NCCL with
blocking wait raises ``DistBackendError``) is re-raised as ``CollectiveTimeout`` naming the phase, the
rank and ``trainer.timeout_minutes`` (the process-group timeout set by ``init_distributed``).

That alone bounds nothing on its own rank: a reward function that never returns, or (NCCL, torch 2.11,
checked on 2 x H200 with ``benchmarks/check_nccl_timeout.py``) a stuck collective, whose watchdog logs
"Watchdog caught collective operation timeout" while the host stays blocked in the next CUDA sync. So on
every backend a monitor thread bounds each phase (``MEGATRON_RL_PHASE_MONITOR=0`` turns it off): a phase
that runs ``timeout_minutes`` without entering or leaving a phase inside it writes an error naming the
phase (and the phases around it) to stderr and ``error_rank<R>.log``, ends this process's children and
exits with ``EXIT_STUCK``, so the launcher tears the job down instead of hanging.
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
# stack: the open phases (name, timeout minutes, what), innermost last; since: when the innermost started
# or the last phase inside it ended (the clock the bound applies to)
_state: dict = {"error_dir": None, "stack": [], "since": 0.0, "poll": _POLL_S, "thread": None}


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
    return os.environ.get("MEGATRON_RL_PHASE_MONITOR", "1") != "0"


def _stuck_message(stack: list[tuple[str, float, str | None]], rank: int) -> str:
    name, minutes, what = stack[-1]
    runs = f"; it runs {what}" if what else ""
    inside = "".join(f", inside phase '{outer}'" for outer, _, _ in reversed(stack[:-1]))
    return (
        f"rank {rank}: phase '{name}' has not finished after {minutes:g} min (trainer.timeout_minutes){runs}"
        f"{inside}. Either that work is stuck or slow, or a collective in it waits for a rank that did not "
        "arrive (look for an earlier error on the other ranks, error_rank<R>.log; NCCL only logs 'Watchdog "
        "caught collective operation timeout'). Raise trainer.timeout_minutes if this phase is legitimately "
        "slower. Ending this process."
    )


def _report_and_exit(message: str) -> None:
    print(f"megatron-rl: error: PhaseTimeout: {message}", file=sys.stderr, flush=True)
    if _state["error_dir"]:
        with contextlib.suppress(OSError):
            log = Path(_state["error_dir"]) / f"error_rank{_rank()}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(f"PhaseTimeout: {message}\n")
    from megatron_rl.distributed.shutdown import end_children

    with contextlib.suppress(Exception):
        end_children()  # os._exit skips the interpreter's exit handlers that would end them
    os._exit(EXIT_STUCK)


def _monitor() -> None:
    while True:
        time.sleep(_state["poll"])
        stack, since = list(_state["stack"]), _state["since"]
        if stack and time.monotonic() - since > stack[-1][1] * 60:
            _report_and_exit(_stuck_message(stack, _rank()))


def _enter(name: str, timeout_minutes: float, what: str | None) -> None:
    if _state["thread"] is None:
        _state["thread"] = threading.Thread(target=_monitor, name="megatron-rl-phase-monitor", daemon=True)
        _state["thread"].start()
    # a tenth of the limit, so that a short limit is enforced about as precisely as a long one
    _state["poll"] = min(_state["poll"], max(0.05, timeout_minutes * 6))
    _state["since"] = time.monotonic()
    _state["stack"].append((name, timeout_minutes, what))


def _leave() -> None:
    _state["stack"].pop()
    _state["since"] = time.monotonic()


@contextlib.contextmanager
def phase(name: str, timeout_minutes: float | None = None, what: str | None = None):
    """Name what this rank is doing (``what``: a few words for the error, e.g. "the reward function").
    A collective timeout inside becomes a ``CollectiveTimeout``; with ``timeout_minutes``, running that
    long without a phase change ends the process with an error naming the phase."""
    watch = timeout_minutes is not None and _monitored()
    if watch:
        _enter(name, timeout_minutes, what)
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
            _leave()
