"""A checkpoint write that failed, as one paragraph: what failed, where, and (disk full) how much was needed.

torch's distributed checkpoint wraps each rank's failure in a ``CheckpointException`` (a BaseException)
and megatron-core's writer processes report theirs as "Worker failure" text, so a full disk is recognised
by its errno where the exception survives and by its message where only text does.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from megatron_rl.checkpoint.layout import CheckpointError, list_step_dirs, read_manifest

_DISK_FULL_TEXT = (os.strerror(errno.ENOSPC), f"[Errno {errno.ENOSPC}]", os.strerror(errno.EDQUOT))


class CheckpointDiskFull(CheckpointError):
    """The disk filled up while a checkpoint was written."""


def is_disk_full(text: str) -> bool:
    return any(t in text for t in _DISK_FULL_TEXT)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"


def _previous(root: Path) -> tuple[Path | None, int]:
    """The newest published checkpoint and its size from its manifest (what the next one needs, roughly)."""
    for d in list_step_dirs(root):
        info, reason = read_manifest(d)
        if reason is None:
            sizes = [v["size"] if isinstance(v, dict) else v for v in info["files"].values()]
            return d, int(sum(sizes))
    return None, 0


def save_failure(step: int, tmp: Path, root: Path, written: int, failures: list[str]) -> CheckpointError:
    """The error to raise once the partial write ``tmp`` is removed; ``failures``: each failed rank's error."""
    prev, prev_bytes = _previous(root)
    kept = f"the previous checkpoint {prev} is intact" if prev else "there is no earlier checkpoint"
    if any(is_disk_full(f) for f in failures):
        usage = shutil.disk_usage(root if root.exists() else root.parent)
        need = (f"about {_gib(prev_bytes)} (the size of {prev.name})" if prev else
                f"more than the {_gib(written)} written before the disk filled")  # fmt: skip
        return CheckpointDiskFull(
            f"the disk is full: writing the checkpoint of step {step} to {tmp} failed with 'No space left on "
            f"device'. The filesystem holding {root} has {_gib(usage.free)} free of {_gib(usage.total)}; the "
            f"checkpoint needs {need}. The partial write was removed and {kept}. Free space there, lower "
            "trainer.max_ckpt_to_keep or point trainer.output_dir at a larger disk, then run the same command "
            "to resume"
        )
    return CheckpointError(
        f"writing the checkpoint of step {step} to {tmp} failed ({failures[0]}); the partial write was removed "
        f"and {kept}. Fix the cause and run the same command to resume"
    )
