"""Clean stops: SIGTERM/SIGINT stop every rank at the same step boundary, and no child process outlives
the run.

Signals. slurm and Kubernetes send SIGTERM some time before they kill a job, and Ctrl-C sends SIGINT.
Either may reach one rank or all of them. The handler only records the signal; the training loop calls
``agreed_stop()`` before each step (none after the last: a signal during the last step lets the run end
normally), a MAX all-reduce of that record over the world, so every rank sees the same answer at the same
step and they all save and stop together (megatron-LM's exit-signal handler works the same way). A second
signal of the same kind on a rank stops that rank at once (default action). After a signal the trainer exits
with ``EXIT_SIGNALLED``.

Child processes. megatron-core's checkpoint writer keeps a results queue in a ``spawn``-started
multiprocessing Manager (about 270 MB) that lives until interpreter exit, and that Manager keeps
multiprocessing's resource tracker alive. A process killed by a signal skips the interpreter's exit
handlers, so both used to outlive the run forever. Here the Manager is started by us (``own_children``
swaps megatron-core's queue factory for ours) with SIGTERM/SIGINT ignored (a signal to the process group,
as torchrun sends, must not break the save that follows it) and a thread that ends it when its parent is
gone (even after a SIGKILL); ``end_children()`` shuts it down and ends any other descendant on every exit
path (normal, error, signal, stuck-phase monitor).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.managers import SyncManager

import torch
import torch.distributed as dist

# sysexits' EX_TEMPFAIL ("temporary failure; the user is invited to retry"): stopped on request, the
# checkpoint (trainer.save_on_signal) is written, and the same command resumes. Distinct from 1 (error),
# 2 (bad input) and 3 (a phase ran past trainer.timeout_minutes).
EXIT_SIGNALLED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_END_GRACE_S = 5.0
_state: dict = {"received": 0, "pid": None, "manager": None, "queue": None}


def _handle(signum: int, frame) -> None:
    if os.getpid() != _state["pid"]:
        return  # a forked checkpoint-writer child: keep writing, its parent decides when to stop
    if _state["received"] == signum:  # the second one: stop now
        end_children()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _state["received"] = signum
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    name = signal.Signals(signum).name
    # os.write, not print: a handler may interrupt a print to the same stream
    os.write(2, f"megatron-rl: rank {rank} got {name}: finishing this step on every rank, then saving and "
                f"stopping (send {name} again to stop this rank at once)\n".encode())  # fmt: skip


def install_stop_handlers() -> None:
    """Record SIGTERM/SIGINT instead of dying at once (call from the main thread, before training)."""
    _state["pid"], _state["received"] = os.getpid(), 0
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handle)


def agreed_stop(dev: torch.device | None = None) -> str | None:
    """Collective over the default group: the name of the signal any rank received, else None.
    Every rank must call it at the same point (before each step)."""
    flag = torch.tensor([_state["received"]], dtype=torch.int64, device=dev)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    signum = int(flag.item())
    return signal.Signals(signum).name if signum else None


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _writer_manager_init() -> None:
    """Runs first in the checkpoint writer's Manager process."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()


def _owned_results_queue():
    """Drop-in for megatron-core's ``filesystem_async._get_write_results_queue``: the same kind of queue,
    from a Manager this module owns and ends."""
    if _state["queue"] is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=_writer_manager_init)
        _state["manager"], _state["queue"] = manager, manager.Queue()
    return _state["queue"]


def own_children() -> None:
    """Make megatron-core's checkpoint writer take its results queue from ``_owned_results_queue``."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not callable(getattr(filesystem_async, "_get_write_results_queue", None)):
        raise RuntimeError(
            "megatron-core's filesystem_async has no _get_write_results_queue any more: update "
            "megatron_rl/distributed/shutdown.py for this megatron-core version"
        )
    filesystem_async._get_write_results_queue = _owned_results_queue


def _tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def end_children() -> None:
    """Shut down the writer Manager, then end every other descendant (terminate, then kill after a
    grace period). multiprocessing's resource tracker is left to exit with this process, as it does once
    its last user has gone."""
    import psutil

    manager, _state["manager"], _state["queue"] = _state["manager"], None, None
    if manager is not None:
        with contextlib.suppress(Exception):
            manager.shutdown()
    try:
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid != _tracker_pid()]
    except psutil.Error:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=_END_GRACE_S)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


@contextlib.contextmanager
def ended_children():
    """Run the block; on any way out of it, ``end_children()``."""
    try:
        yield
    finally:
        end_children()
