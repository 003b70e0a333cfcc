"""Which checkpoints on disk are complete and intact; publishing, rotation, the metrics file of a resumed run.

The directory layout and every name are in ``names.py``. A checkpoint is complete when ``complete.json``
parses and every file it lists exists with its size and its content digest (blake2b). Pure filesystem
code: no process groups here (``checkpointer.py`` spreads the digests over ranks).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

from megatron_rl.checkpoint.names import (
    CKPT_DIR,
    DIST,
    DIST_SHARD,
    MANIFEST,
    POINTER,
    RNG,
    RNG_SHARD,
    STATE,
    STEP_DIR,
    TMP_PREFIX,
)

DIGEST = "blake2b"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what to change."""


def ckpt_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CKPT_DIR


def step_of(path: Path) -> int | None:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def write_json_atomic(path: Path, obj) -> None:
    """Write ``obj`` as JSON through a temporary file, fsync, rename: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_digest(path: Path) -> str:
    """blake2b of the file's content, streamed (a few GB/s: small next to writing the file)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()


def files_of(step_dir: Path) -> list[str]:
    """Every file under ``step_dir`` but the manifest, as sorted relative paths."""
    return sorted(
        str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def writer_rank(rel: str) -> int:
    """The rank that wrote a checkpoint file: torch_dist shards and RNG files carry it in their name,
    rank 0 writes the rest. That rank digests the file right after writing it."""
    parts = Path(rel).parts
    if len(parts) == 2 and parts[0] in (DIST, RNG):
        m = (DIST_SHARD if parts[0] == DIST else RNG_SHARD).match(parts[1])
        if m:
            return int(m.group(1))
    return 0


def digest_files(step_dir: Path, rels: list[str]) -> dict[str, dict]:
    """``{rel: {"size", "blake2b"}}`` of the given files."""
    return {r: {"size": (step_dir / r).stat().st_size, DIGEST: file_digest(step_dir / r)} for r in rels}


def write_manifest(step_dir: Path, step: int, digests: dict[str, dict] | None = None) -> None:
    """The last file written into a checkpoint: every file with its size and digest. ``digests``: the ones
    the writing ranks computed; files missing from it are digested here."""
    digests = dict(digests or {})
    missing = [r for r in files_of(step_dir) if r not in digests]
    digests |= digest_files(step_dir, missing)
    write_json_atomic(
        step_dir / MANIFEST, {"step": step, "finite": True, "files": dict(sorted(digests.items()))}
    )


def read_manifest(step_dir: Path) -> tuple[dict | None, str | None]:
    """(manifest, None), or (None, the reason it cannot be used)."""
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        return None, f"no {MANIFEST} (the write did not finish)"
    try:
        info = json.loads(manifest.read_text())
        files, step = info["files"], int(info["step"])
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{MANIFEST} is unreadable ({err})"
    if step_of(step_dir) is not None and step != step_of(step_dir):
        return None, f"{MANIFEST} says step {step}"
    return info, None


def _entry(v) -> tuple[int, str | None]:
    """A manifest entry: ``{"size", "blake2b"}``; checkpoints written before digests hold the size only."""
    return (int(v["size"]), v.get(DIGEST)) if isinstance(v, dict) else (int(v), None)


def check_files(
    step_dir: Path, files: dict, rels: list[str] | None = None, digests: bool = True
) -> str | None:
    """None if the listed files (``rels``, default all) exist with the manifest's size (and digest)."""
    for rel in files if rels is None else rels:
        size, digest = _entry(files[rel])
        p = step_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != size:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {size}"
        if digests and digest is not None:
            try:
                got = file_digest(p)
            except OSError as err:
                return f"{rel} is unreadable ({err})"
            if got != digest:
                return (
                    f"{rel} has other content than was written (its {DIGEST} digest differs from {MANIFEST})"
                )
    return None


def check_complete(step_dir: Path, digests: bool = True) -> str | None:
    """None if ``step_dir`` is a complete, intact checkpoint, else the reason it is not. ``digests=False``
    checks sizes only (cheap: for rotation)."""
    info, reason = read_manifest(step_dir)
    if reason:
        return reason
    reason = check_files(step_dir, info["files"], digests=digests)
    if reason:
        return reason
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


RESUME_MODES = ("auto", "disable", "path")


def resume_candidates(resume_mode: str, output_dir: str | Path, resume_from_path: str | None) -> list[Path]:
    """The checkpoints ``trainer.resume_mode`` may resume from, newest first (to be verified in that order).

    auto: every ``global_step_<N>`` under ``<output_dir>/checkpoints``; path: the ``global_step_<N>``
    directory ``resume_from_path`` names (it must be complete), or those under it; disable: none."""
    if resume_mode not in RESUME_MODES:
        raise CheckpointError(f"trainer.resume_mode={resume_mode!r}; use one of {', '.join(RESUME_MODES)}")
    if resume_mode == "disable":
        return []
    if resume_mode == "auto":
        return list_step_dirs(ckpt_root(output_dir))
    if not resume_from_path:
        raise CheckpointError("trainer.resume_mode=path needs trainer.resume_from_path=<global_step_N dir>")
    p = Path(resume_from_path)
    if not p.exists():
        raise CheckpointError(f"trainer.resume_from_path={resume_from_path!r} does not exist; point it at a "
                              f"global_step_<N> directory or at <output_dir>/{CKPT_DIR}")  # fmt: skip
    if (p / MANIFEST).exists() or step_of(p) is not None:
        reason = check_complete(p, digests=False)
        if reason:
            raise CheckpointError(f"trainer.resume_from_path={resume_from_path!r} is not a complete checkpoint: "
                                  f"{reason}. Pick an older global_step_<N> or use trainer.resume_mode=auto")  # fmt: skip
        return [p]
    found = list_step_dirs(p) or list_step_dirs(p / CKPT_DIR)
    if not found:
        raise CheckpointError(f"trainer.resume_from_path={resume_from_path!r} holds no global_step_<N> "
                              "checkpoint; use trainer.resume_mode=disable to start fresh")  # fmt: skip
    return found


def resolve_resume_path(path: str) -> Path:
    """``trainer.resume_from_path``: a complete ``global_step_<N>`` directory, or the newest complete
    one under a directory holding them (rank-0 check of every file's digest)."""
    for d in resume_candidates("path", ".", path):
        reason = check_complete(d)
        if reason is None:
            return d
        warnings.warn(f"skipping checkpoint {d}: {reason}; trying the previous one", stacklevel=2)
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


def is_finite(step_dir: Path) -> bool:
    """The manifest records that the weights were checked finite before the write."""
    info, _ = read_manifest(step_dir)
    return bool(info and info.get("finite"))


def rotate(root: Path, keep: int, newest: Path) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (keep <= 0 keeps all); returns the removed.

    Only once ``newest`` (the checkpoint just published) is complete: its digests were taken by reading
    back the written files, its sizes are checked here. The newest checkpoint recorded as finite is never
    deleted, whatever ``keep`` says."""
    if keep <= 0 or check_complete(newest, digests=False) is not None:
        return []
    complete = [d for d in list_step_dirs(root) if check_complete(d, digests=False) is None]
    finite = [d for d in complete if is_finite(d)]
    removed = [d for d in complete[keep:] if not finite or d != finite[0]]
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
