"""Checkpoints one can trust (issue 20), the parts that need no training run: the restricted unpickler and
its hook into torch's reader, content digests, rotation, the output-directory lock, changed settings on
resume, the disk-full message and the non-finite update check."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_rl.checkpoint import resume_config, run_lock, safe_load
from megatron_rl.checkpoint.layout import check_complete, rotate, write_manifest
from megatron_rl.checkpoint.safe_load import UnsafeCheckpointError
from megatron_rl.checkpoint.save_errors import CheckpointDiskFull, is_disk_full, save_failure
from megatron_rl.trainer.workers import NonFiniteUpdate, at_step, check_finite


class _Payload:
    """Unpickling this creates ``marker``: what a malicious checkpoint would do (run code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _dcp_dir(tmp_path: Path, state: dict) -> Path:
    out = tmp_path / "dist"
    dcp.save(state, checkpoint_id=str(out), no_dist=True)
    return out


def test_metadata_payload_is_refused_naming_the_file(tmp_path):
    ckpt = _dcp_dir(tmp_path, {"w": torch.arange(4.0)})
    safe_load.install()
    genuine = dcp.FileSystemReader(str(ckpt)).read_metadata()  # a real metadata file still loads
    assert list(genuine.state_dict_metadata) == ["w"]
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    for read in (lambda: safe_load.read_metadata_file(ckpt / ".metadata"),
                 lambda: dcp.FileSystemReader(str(ckpt)).read_metadata(),
                 lambda: dcp.load({"w": torch.zeros(4)}, checkpoint_id=str(ckpt), no_dist=True)):  # fmt: skip
        with pytest.raises(BaseException, match=r"\.metadata refers to pathlib\.") as err:
            read()
        assert isinstance(safe_load._unwrap(err.value), (UnsafeCheckpointError, safe_load.RefusedPickle))
    assert not marker.exists()


def test_byte_item_payload_is_refused(tmp_path):
    """Non-tensor items (megatron-core's _extra_state, optimizer common state) are pickles too."""
    marker = tmp_path / "pwned"
    ckpt = _dcp_dir(tmp_path, {"extra": _Payload(marker), "w": torch.ones(2)})
    assert not marker.exists()
    safe_load.install()
    with pytest.raises(BaseException) as err:
        dcp.load({"extra": None, "w": torch.zeros(2)}, checkpoint_id=str(ckpt), no_dist=True)
    inner = safe_load._unwrap(err.value)
    assert isinstance(inner, safe_load.RefusedPickle) and "'extra'" in str(inner)
    assert not marker.exists()
    state = {"extra": None, "w": torch.zeros(2)}
    dcp.load(state, checkpoint_id=str(_dcp_dir(tmp_path / "ok", {"extra": [None], "w": torch.ones(2)})),
             no_dist=True)  # fmt: skip
    assert state["extra"] == [None] and torch.equal(state["w"], torch.ones(2))


def test_hooked_torch_methods_are_the_pinned_ones():
    """Fails when torch changes the methods replaced by safe_load (re-check what they read, then re-pin)."""
    for (cls, name), original in safe_load.ORIGINALS.items():
        digest = hashlib.sha256(inspect.getsource(original).encode()).hexdigest()[:16]
        assert digest == safe_load.PINNED_SOURCE[name], f"{cls.__name__}.{name} changed in this torch"
    safe_load.install()
    for (cls, name), patched in safe_load.PATCHED.items():
        assert getattr(cls, name) is patched


def test_force_no_weights_only_env_is_refused(monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(safe_load.CheckpointError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        safe_load.install()


def _ckpt(root: Path, step: int, finite: bool = True) -> Path:
    d = root / f"global_step_{step}"
    (d / "dist").mkdir(parents=True)
    (d / "dist" / "__0_0.distcp").write_bytes(os.urandom(64))
    (d / "state.json").write_text(json.dumps({"step": step}))
    write_manifest(d, step)
    if not finite:  # as a checkpoint written before weights were checked would look
        info = json.loads((d / "complete.json").read_text())
        (d / "complete.json").write_text(json.dumps({**info, "finite": False}))
    return d


def test_digests_catch_same_size_corruption_and_state_edits(tmp_path):
    d = _ckpt(tmp_path, 6)
    assert check_complete(d) is None
    shard = d / "dist" / "__0_0.distcp"
    shard.write_bytes(os.urandom(shard.stat().st_size))
    assert "dist/__0_0.distcp has other content" in check_complete(d)
    assert check_complete(d, digests=False) is None  # the size-only check of before would have passed
    d2 = _ckpt(tmp_path / "b", 6)
    (d2 / "state.json").write_text((d2 / "state.json").read_text().replace("6", "5"))
    assert "state.json has other content" in check_complete(d2)


def test_rotation_waits_for_the_new_checkpoint_and_keeps_the_newest_finite(tmp_path):
    _ckpt(tmp_path, 1)
    _ckpt(tmp_path, 2, finite=False)
    _ckpt(tmp_path, 3, finite=False)
    new = tmp_path / "global_step_4"
    new.mkdir()  # published but incomplete: nothing may be deleted yet
    assert rotate(tmp_path, 1, new) == []
    _ckpt(tmp_path, 5, finite=False)
    removed = rotate(tmp_path, 1, tmp_path / "global_step_5")
    assert sorted(p.name for p in removed) == ["global_step_2", "global_step_3"]
    assert (tmp_path / "global_step_1").is_dir(), "the newest finite checkpoint was deleted"


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / ".megatron_rl.lock"
        started = run_lock._start_time(holder.pid)
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "started": started}))
        with pytest.raises(run_lock.OutputDirLocked, match=rf"host {socket.gethostname()}, pid {holder.pid}.*"
                           r"delete .*\.megatron_rl\.lock or set trainer\.force_unlock=true"):  # fmt: skip
            run_lock.acquire(tmp_path)
        lock.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
        with pytest.raises(run_lock.OutputDirLocked, match="host elsewhere, pid 1"):
            run_lock.acquire(tmp_path)
        with pytest.warns(UserWarning, match="trainer.force_unlock=true"):
            run_lock.acquire(tmp_path, force=True)
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "started": started}))
    with pytest.warns(UserWarning, match="its process is gone"):
        run_lock.acquire(tmp_path)
    run_lock.release(lock)
    assert not lock.exists()


def test_changed_settings_are_applied_and_logged_or_refused():
    saved = {"actor": {"optim": {"lr": 1e-6, "betas": [0.9, 0.999]}}, "trainer": {"test_freq": 5}}
    now = {"actor": {"optim": {"lr": 2e-6, "betas": [0.9, 0.999]}}, "trainer": {"test_freq": 2}}
    found = resume_config.changes(saved, now)
    notes = resume_config.review(found, "ckpt")
    assert notes == [
        "megatron-rl: resume: actor.optim.lr: 1e-06 -> 2e-06 since the checkpoint; applied to the LR schedule "
        "from the resumed step",
        "megatron-rl: resume: trainer.test_freq: 5 -> 2 since the checkpoint; applied",
    ]
    now["actor"]["optim"]["betas"] = [0.8, 0.999]
    with pytest.raises(
        resume_config.CheckpointError, match=r"actor\.optim\.betas: \[0\.9, 0\.999\] -> \[0\.8"
    ):
        resume_config.review(resume_config.changes(saved, now), "ckpt")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    sched.step(), sched.step()
    resume_config.apply_schedule(sched, resume_config.schedule_peak(found, "actor"))
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-6 / 3) and sched.get_last_lr() == [2e-6 / 3]


def test_disk_full_is_one_paragraph_naming_place_and_size(tmp_path):
    prev = _ckpt(tmp_path, 1)
    err = save_failure(2, tmp_path / ".tmp_global_step_2", tmp_path, 10,
                       ["RuntimeError('Worker failure: [Errno 28] No space left on device')"])  # fmt: skip
    assert isinstance(err, CheckpointDiskFull) and "\n" not in str(err)
    size = sum(p.stat().st_size for p in prev.rglob("*") if p.is_file() and p.name != "complete.json")
    assert f"needs about {size / 2**20:.1f} MiB (the size of global_step_1)" in str(err)
    assert f"previous checkpoint {prev} is intact" in str(err) and "the disk is full" in str(err)
    assert is_disk_full(str(OSError(28, os.strerror(28)))) and not is_disk_full("Permission denied")


def test_nonfinite_update_names_step_and_phase_or_is_counted():
    info = [{"grad_norm": torch.tensor(1.0)}, {"grad_norm": torch.tensor(float("nan"))}]
    with pytest.raises(NonFiniteUpdate, match=r"step 7: update_critic: .*1 of 2 optimizer steps"):
        with at_step(7):
            check_finite(info, {"vf_loss": 0.1}, "critic", skip=False)
    assert check_finite(info, {"pg_loss": 0.1}, "actor", skip=True) == {"actor/nonfinite_skipped": 1.0}
    with pytest.raises(NonFiniteUpdate, match="losses"):
        check_finite(info[:1], {"pg_loss": float("inf")}, "actor", skip=False)
    assert check_finite(info[:1], {"pg_loss": 0.1}, "actor", skip=False) == {"actor/nonfinite_skipped": 0.0}
