"""Clean stops: a SIGTERM reaching one rank stops every rank after the same step, writes a checkpoint, exits
with EXIT_SIGNALLED and leaves no process behind; the same command then resumes and reproduces the
uninterrupted run bit for bit (CPU, world 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megatron_rl.distributed.shutdown import EXIT_SIGNALLED
from tests.distributed.launch import cpu_env
from tests.integration.cli import metrics
from tests.integration.test_checkpoint_resume import (
    SMALL,
    _comparable,
    _kill_session,
    _pointer,
    _torchrun_cmd,
    train,
)

# A step here takes ~40 ms unloaded. The signal must reach rank 1 before the stop check ahead of the last
# step, or the run just finishes (exit 0): with 4 steps that window was ~80 ms after step 1 was logged, which
# the poller missed on a loaded machine (session 42). 12 steps give it ~10 steps.
STEPS = 12
ARGS = [*SMALL, "trainer.save_freq=-1", f"trainer.total_training_steps={STEPS}"]  # only the signal saves


def _logged_steps(out: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []


def _rank_process(launcher: psutil.Process, rank: str) -> psutil.Process | None:
    for p in launcher.children(recursive=True):
        try:
            if p.environ().get("RANK") == rank and "megatron_rl.train" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def _sigterm_one_rank_after_step(out: Path, step: int) -> tuple[subprocess.CompletedProcess, set]:
    """Start a world-2 run; once ``step`` is logged, SIGTERM rank 1 alone. Returns the finished launcher and
    every process seen below it while it ran."""
    cmd = _torchrun_cmd(out, 2, *ARGS)
    proc = subprocess.Popen(cmd, env=cpu_env(), cwd=out.parent, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    launcher, seen, signalled = psutil.Process(proc.pid), set(), False
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= {(p.pid, p.create_time()) for p in launcher.children(recursive=True)}
            if not signalled and step in _logged_steps(out) and (rank1 := _rank_process(launcher, "1")):
                rank1.send_signal(signal.SIGTERM)
                signalled = True
            time.sleep(0.05)
        out_text, err_text = proc.communicate(timeout=120)
    finally:
        _kill_session(proc.pid)
    assert signalled, f"step {step} was never logged:\n{err_text[-4000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out_text, err_text), seen


def _alive(seen: set) -> list[str]:
    left = []
    for pid, created in seen:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            continue
    return left


def test_sigterm_to_one_rank_stops_all_saves_and_resume_matches_uninterrupted(tmp_path):
    ref_out, out = tmp_path / "ref", tmp_path / "signalled"
    ref = train(ref_out, *ARGS, nproc=2)
    assert ref.returncode == 0, ref.stderr[-4000:]

    stopped, seen = _sigterm_one_rank_after_step(out, 1)
    log = stopped.stdout + stopped.stderr
    assert "rank 1 got SIGTERM" in log and "rank 0 got SIGTERM" not in log  # it reached one rank only
    lines = [
        line for line in stopped.stdout.splitlines() if line.startswith("megatron-rl: stopped by SIGTERM")
    ]
    assert len(lines) == 1, log[-4000:]  # one line, from rank 0, though rank 0 never got the signal
    at = int(lines[0].split("after step ")[1].split()[0])
    assert 1 <= at < STEPS and f"global_step_{at}" in lines[0] and f"exit code {EXIT_SIGNALLED}" in lines[0]
    assert f"exitcode  : {EXIT_SIGNALLED}" in stopped.stderr  # torchrun's summary of both ranks' exits
    assert _logged_steps(out) == list(range(1, at + 1))  # metrics flushed up to the step it stopped after
    assert int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text()) == at
    time.sleep(1.0)  # the resource tracker exits once its last user has gone
    assert not _alive(seen), f"processes outlived the run: {_alive(seen)}"

    resumed = train(out, *ARGS, nproc=2)  # the same command
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'global_step_{at}'}" in resumed.stdout + resumed.stderr
    got, want = _comparable(metrics(out)), _comparable(metrics(ref_out))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == want[step], f"step {step} differs after the signal and resume"


def test_sigterm_to_a_single_process_run_leaves_no_child(tmp_path):
    """The issue's case: SIGTERM to the main process during a checkpointing run used to leave megatron-core's
    checkpoint-writer Manager and the resource tracker running forever."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl.train", f"trainer.output_dir={out}", "trainer.logger=[jsonl]",
           *SMALL, "trainer.total_training_steps=50"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=cpu_env(), cwd=tmp_path, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    main, seen, deadline = psutil.Process(proc.pid), set(), time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline and not _pointer(out):
            seen |= {(p.pid, p.create_time()) for p in main.children(recursive=True)}
            time.sleep(0.05)
        seen |= {(p.pid, p.create_time()) for p in main.children(recursive=True)}
        assert seen, (
            f"the checkpoint writer started no process: nothing to check\n{proc.stderr.read()[-3000:]}"
        )
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        _kill_session(proc.pid)
    assert proc.returncode == EXIT_SIGNALLED, err[-4000:]
    time.sleep(1.0)
    assert not _alive(seen), f"processes outlived the run: {_alive(seen)}"
