"""Checkpoints one can trust (issue 20) on a real run's checkpoints: one 2-step training run writes them,
one world-1 worker (tests/distributed/workers/ckpt_trust_worker.py) builds the trainer once and runs every
scenario on copies, and the CLIs a user would call are checked where the entry point matters (the
converter on a malicious checkpoint, a second run on a locked output directory)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.distributed.launch import REPO, cpu_env
from tests.integration.cli import FAST, train
from tests.integration.test_checkpoint_resume import SMALL

WORKER = REPO / "tests" / "distributed" / "workers" / "ckpt_trust_worker.py"
ARGS = [*SMALL, "trainer.total_training_steps=2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust")
    base = tmp / "base"
    proc = train(base, *ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (base / ".megatron_rl.lock").exists(), "the run did not release its output-dir lock"
    run = subprocess.run([sys.executable, str(WORKER), str(base), str(tmp), *ARGS, *FAST], capture_output=True,
                         text=True, timeout=900, env=cpu_env(), cwd=tmp)  # fmt: skip
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULTS ")]
    assert run.returncode == 0 and lines, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return {**json.loads(lines[-1][len("RESULTS ") :]), "tmp": tmp}


def test_same_size_corruption_falls_back_to_the_previous_checkpoint(results):
    r = results["fallback"]
    assert r["step"] == 1
    assert len(r["skipped"]) == 1 and "global_step_2" in r["skipped"][0]
    assert f"dist/{r['shard']} has other content" in r["skipped"][0]


def test_every_checkpoint_unusable_stops_and_keeps_the_metrics(results):
    r = results["unusable"]
    err = r["error"]
    assert err.startswith("CheckpointError: no usable checkpoint")
    assert "global_step_2" in err and "state.json is unreadable" in err
    assert "global_step_1" in err and "rng/rank_00000.pt is unreadable" in err
    assert "trainer.resume_mode=disable" in err and r["metrics_kept"]
    assert len(r["skipped"]) == 2


def test_malicious_metadata_is_refused_on_every_load_path(results):
    r = results["malicious"]
    for path in ("resume", "weights", "generate"):
        assert r[path] and r[path].startswith("UnsafeCheckpointError"), (path, r[path])
        assert "dist/.metadata refers to pathlib" in r[path], (path, r[path])
    assert not r["marker"], "the payload ran"


def test_malicious_metadata_is_refused_by_the_converter_cli(results):
    ckpt, out = results["malicious"]["checkpoint"], results["tmp"] / "hf_out"
    marker = results["tmp"] / "PWNED"
    proc = subprocess.run([sys.executable, str(REPO / "checkpoints_tools" / "megatron_to_hf.py"), "--checkpoint",
                           ckpt, "--output", str(out)], capture_output=True, text=True, timeout=300,
                          env=cpu_env(), cwd=results["tmp"])  # fmt: skip
    assert proc.returncode != 0 and ".metadata refers to pathlib" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists() and not (out / "model.safetensors").exists()


@pytest.mark.parametrize("where", ["disk_full", "disk_full_manifest"])  # a shard, or the last file (rank 0)
def test_disk_full_is_one_paragraph_and_leaves_the_previous_checkpoint(results, where):
    r = results[where]
    assert r["error"].startswith("CheckpointDiskFull: the disk is full"), r["error"]
    assert ".tmp_global_step_3" in r["error"] and "needs about" in r["error"] and "\n" not in r["error"]
    assert r["left"] == ["global_step_1", "global_step_2", "latest_checkpointed_iteration.txt"]
    assert r["previous_ok"]


def test_no_checkpoint_from_nonfinite_weights(results):
    r = results["nan_save"]
    assert "weights after step 3 hold NaN or Inf" in r["error"]
    assert r["left"] == ["global_step_1", "global_step_2", "latest_checkpointed_iteration.txt"]


def test_changed_betas_are_refused_naming_key_and_values(results):
    err = results["betas"]["error"]
    assert "actor.optim.betas: [0.9, 0.999] -> [0.5, 0.999]" in err and "trainer.resume_mode=disable" in err


def test_changed_lr_is_applied_to_the_schedule_and_logged(results):
    r = results["lr"]
    assert r["step"] == 2 and r["base"] == r["old"] * 0.5
    assert r["lr"] == pytest.approx(r["old"] * 0.5)  # the built-in run's schedule is constant
    assert (
        f"actor.optim.lr: {r['old']!r} -> {r['old'] * 0.5!r} since the checkpoint; applied to the LR"
        in r["log"]
    )


def test_nonfinite_gradient_stops_naming_step_and_phase_or_is_skipped(results):
    r = results["nonfinite"]
    assert r["error"].startswith("NonFiniteUpdate: step 3: update_actor: non-finite"), r["error"]
    assert r["skipped"] == 1.0 and r["unchanged"]


def test_second_run_on_a_locked_output_dir_is_refused_before_any_work(tmp_path):
    out = tmp_path / "locked"
    out.mkdir()
    lock = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time()}
    (out / ".megatron_rl.lock").write_text(json.dumps(lock))
    proc = train(out, *ARGS)
    assert proc.returncode != 0
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in proc.stderr, proc.stderr[-3000:]
    assert "trainer.force_unlock=true" in proc.stderr
    assert not (out / "builtin_task").exists() and not (out / "metrics.jsonl").exists()


def _start_time() -> float:
    import psutil

    return psutil.Process(os.getpid()).create_time()
