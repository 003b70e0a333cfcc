"""Checkpoint directory bookkeeping (pure filesystem): completeness, fallback, rotation, metrics truncation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_rl.checkpoint import (
    CheckpointError,
    check_complete,
    newest_complete,
    resume_candidates,
    truncate_metrics,
)
from megatron_rl.checkpoint.layout import (
    publish,
    read_pointer,
    resolve_resume_path,
    rotate,
    write_manifest,
    write_pointer,
)


def _ckpt(root, step, complete=True):
    d = root / f"global_step_{step}"
    (d / "dist").mkdir(parents=True)
    (d / "dist" / "__0_0.distcp").write_bytes(b"x" * 10)
    (d / "state.json").write_text(json.dumps({"step": step}))
    if complete:
        write_manifest(d, step)
    return d


def test_newest_complete_skips_incomplete_and_truncated(tmp_path):
    _ckpt(tmp_path, 1)
    d2 = _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 3, complete=False)
    (d2 / "dist" / "__0_0.distcp").write_bytes(b"x")  # torn file: size differs from the manifest
    assert "has 1 bytes" in check_complete(d2)
    with pytest.warns(UserWarning, match="skipping checkpoint .*global_step_3: no complete.json"):
        assert newest_complete(tmp_path) == tmp_path / "global_step_1"


def test_rotate_keeps_newest_complete(tmp_path):
    for s in (1, 2, 3):
        _ckpt(tmp_path, s)
    _ckpt(tmp_path, 4, complete=False)
    rotate(tmp_path, 2, tmp_path / "global_step_3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "global_step_3", "global_step_4"]


def test_publish_and_pointer(tmp_path):
    tmp = tmp_path / ".tmp_global_step_5"
    tmp.mkdir()
    (tmp / "a").write_text("new")
    old = tmp_path / "global_step_5"
    old.mkdir()
    (old / "a").write_text("old")
    publish(tmp, old)
    write_pointer(tmp_path, 5)
    assert (old / "a").read_text() == "new" and not tmp.exists() and read_pointer(tmp_path) == 5


def test_truncate_metrics_keeps_up_to_step(tmp_path):
    lines = [json.dumps({"step": s, "x": s}) for s in (0, 1, 2, 3)] + ['{"step": 4, "x"']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert truncate_metrics(tmp_path, 2) == 2
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    truncate_metrics(tmp_path, 0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def newest_candidate(cfg):
    """The newest candidate ``trainer.resume_mode`` selects (the checkpointer verifies them in order)."""
    tr = cfg.trainer
    found = resume_candidates(tr.resume_mode, tr.output_dir, tr.resume_from_path)
    return found[0] if found else None


def _cfg(out, mode, path=None):
    return SimpleNamespace(
        trainer=SimpleNamespace(output_dir=str(out), resume_mode=mode, resume_from_path=path)
    )


def test_resume_modes(tmp_path):
    root = tmp_path / "checkpoints"
    _ckpt(root, 7)
    assert newest_candidate(_cfg(tmp_path, "auto")) == root / "global_step_7"
    assert newest_candidate(_cfg(tmp_path, "disable")) is None
    assert newest_candidate(_cfg(tmp_path, "path", str(tmp_path))) == root / "global_step_7"
    assert resolve_resume_path(str(root / "global_step_7")) == root / "global_step_7"
    with pytest.raises(CheckpointError, match="trainer.resume_mode='sometimes'"):
        newest_candidate(_cfg(tmp_path, "sometimes"))
    with pytest.raises(CheckpointError, match="needs trainer.resume_from_path"):
        newest_candidate(_cfg(tmp_path, "path"))
    _ckpt(root, 8, complete=False)
    with pytest.raises(
        CheckpointError, match="resume_from_path=.*global_step_8.* is not a complete checkpoint"
    ):
        newest_candidate(_cfg(tmp_path, "path", str(root / "global_step_8")))
