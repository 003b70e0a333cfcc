"""Where checkpoints live on disk and which of them are complete; the metrics file of a resumed run.

Layout under ``<trainer.output_dir>/checkpoints/``::

    latest_checkpointed_iteration.txt    N of the newest complete checkpoint (written last)
    global_step_<N>/
        dist/                             megatron-core torch_dist: actor/critic weights + optimizer states
        rng/rank_<R>.pt                   per-rank RNG states (python, numpy, torch, CUDA, TP tracker)
        state.json                        step, data position, KL controller, LR schedulers, layout
        hf/                               optional HF export of the actor (trainer.save_hf)
        complete.json                     manifest {file: size}, written last inside the directory
    .tmp_global_step_<N>/                 a write in progress (renamed to global_step_<N> when done)

A checkpoint is complete when ``complete.json`` parses and every file it lists exists with its size.
Pure filesystem code: no process groups here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

CKPT_DIR = "checkpoints"
POINTER = "latest_checkpointed_iteration.txt"
MANIFEST = "complete.json"
STATE = "state.json"
DIST = "dist"
RNG = "rng"
HF = "hf"
TMP_PREFIX = ".tmp_"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what to change."""


def ckpt_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CKPT_DIR


def step_dir_name(step: int) -> str:
    return f"global_step_{step}"


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def write_json_atomic(path: Path, obj) -> None:
    """Write ``obj`` as JSON through a temporary file, fsync, rename: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(step_dir: Path, step: int) -> None:
    """List every file under ``step_dir`` with its size; the last file written into a checkpoint."""
    files = {
        str(p.relative_to(step_dir)): p.stat().st_size
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    write_json_atomic(step_dir / MANIFEST, {"step": step, "files": files})


def check_complete(step_dir: Path) -> str | None:
    """None if ``step_dir`` is a complete checkpoint, else the reason it is not."""
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (the write did not finish)"
    try:
        info = json.loads(manifest.read_text())
        files, step = info["files"], int(info["step"])
    except (ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({err})"
    if step_of(step_dir) is not None and step != step_of(step_dir):
        return f"{MANIFEST} says step {step}"
    for rel, size in files.items():
        p = step_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != size:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {size}"
    if not (step_dir / STATE).is_file():
        return f"no {STATE}"
    return None


def list_step_dirs(root: Path) -> list[Path]:
    """``global_step_<N>`` directories under ``root``, newest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(dirs, key=step_of, reverse=True)


def newest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``; newer incomplete ones are skipped with a warning."""
    for d in list_step_dirs(root):
        reason = check_complete(d)
        if reason is None:
            return d
        warnings.warn(f"skipping checkpoint {d}: {reason}; trying the previous one", stacklevel=2)
    return None


def resolve_resume_path(path: str) -> Path:
    """``trainer.resume_from_path``: a ``global_step_<N>`` directory, or a directory holding them."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"trainer.resume_from_path={path!r} does not exist; point it at a "
                              f"global_step_<N> directory or at <output_dir>/{CKPT_DIR}")  # fmt: skip
    if (p / MANIFEST).exists() or step_of(p) is not None:
        reason = check_complete(p)
        if reason:
            raise CheckpointError(f"trainer.resume_from_path={path!r} is not a complete checkpoint: {reason}. "
                                  "Pick an older global_step_<N> or use trainer.resume_mode=auto")  # fmt: skip
        return p
    for root in (p, p / CKPT_DIR):
        found = newest_complete(root)
        if found is not None:
            return found
    raise CheckpointError(f"trainer.resume_from_path={path!r} holds no complete global_step_<N> checkpoint; "
                          "use trainer.resume_mode=disable to start fresh")  # fmt: skip


def read_pointer(root: Path) -> int | None:
    try:
        return int((root / POINTER).read_text().strip())
    except (OSError, ValueError):
        return None


def write_pointer(root: Path, step: int) -> None:
    tmp = root / (POINTER + ".tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, root / POINTER)


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished temporary directory into place (an older directory of that name is replaced)."""
    if final_dir.exists():
        old = final_dir.with_name(TMP_PREFIX + "old_" + final_dir.name)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)


def remove_stale_tmp(root: Path) -> None:
    """Leftovers of writes that were killed (``.tmp_*``); only called when no write is in progress."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def rotate(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (keep <= 0 keeps all); returns the removed."""
    if keep <= 0:
        return []
    complete = [d for d in list_step_dirs(root) if check_complete(d) is None]
    removed = complete[keep:]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


def truncate_metrics(output_dir: str | Path, step: int) -> int:
    """Make ``metrics.jsonl`` / ``generations.jsonl`` end at ``step`` before a resumed run appends to them.

    Keeps the lines with ``step <= step`` (everything logged up to the checkpoint), drops later ones and
    any half-written line left by a killed process; ``step == 0`` (fresh start) keeps nothing.
    Returns the number of lines dropped. Rank 0 only; safe while the jsonl backend holds the file open
    for appending (O_APPEND writes go to the new end).
    """
    dropped = 0
    for name in ("metrics.jsonl", "generations.jsonl"):
        path = Path(output_dir) / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            if step > 0 and row_step <= step:
                kept.append(line)
            else:
                dropped += 1
        with path.open("r+", encoding="utf-8") as f:
            f.truncate(0)
            f.write("".join(line + "\n" for line in kept))
    return dropped
