"""One run per output directory: rank 0 holds ``<output_dir>/.megatron_rl.lock`` (host, pid) for the run.

Two runs on one ``trainer.output_dir`` would delete each other's checkpoint writes and interleave
``metrics.jsonl``. A second run is refused before any work, naming the holder. A lock left by a run that
died (same host, pid gone or reused by another process) is taken over with a warning;
``trainer.force_unlock=true`` takes over any lock (for a holder on another host known to be gone).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
import warnings
from pathlib import Path

import torch.distributed as dist

from megatron_rl.checkpoint.names import LOCK_FILE


class OutputDirLocked(RuntimeError):
    """Another run holds the output directory."""


def _start_time(pid: int) -> float | None:
    """The process's start time, or None if no such process (pid reuse shows as another start time)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip


def _is_stale(holder: dict) -> bool:
    """Same host and the holder process is gone (or its pid now belongs to a newer process)."""
    if holder.get("host") != socket.gethostname():
        return False
    started = _start_time(int(holder.get("pid", -1)))
    return started is None or (holder.get("started") is not None and abs(started - holder["started"]) > 1)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # half-written by a holder killed while taking it: treated as stale below


def acquire(output_dir: str | Path, force: bool = False) -> Path:
    """Take the lock (this process) or raise ``OutputDirLocked``; released at interpreter exit."""
    path = Path(output_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('since', '?')}"
            if not (force or not holder or _is_stale(holder)):
                raise OutputDirLocked(
                    f"trainer.output_dir={output_dir} is in use by another run ({who}): two runs on one directory "
                    f"overwrite each other's checkpoints and metrics. Use another trainer.output_dir, or wait for that "
                    f"run to end. If it is gone (e.g. its machine died), delete {path} or set trainer.force_unlock=true"
                ) from None
            why = "trainer.force_unlock=true" if force else "its process is gone"
            warnings.warn(f"taking over the lock {path} of an earlier run ({who}): {why}", stacklevel=2)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(_me(), f)
        atexit.register(release, path)
        return path
    raise OutputDirLocked(f"{path} was taken by another run at the same moment; start one run per directory")


def release(path: Path) -> None:
    """Remove the lock if this process holds it."""
    if _read(path).get("pid") == os.getpid() and _read(path).get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


def lock_output_dir(output_dir: str | Path, force: bool = False) -> None:
    """Collective: rank 0 takes the lock; every rank raises the same ``OutputDirLocked`` if it cannot."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            acquire(output_dir, force)
        except OutputDirLocked as err:
            error = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise OutputDirLocked(error)
