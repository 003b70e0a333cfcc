"""Checkpoints that survive a SIGKILL: a killed run, restarted with the same command, reproduces the
uninterrupted run's metrics bit for bit (CPU, world 2), and a kill during a checkpoint write falls back to
the previous checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.distributed.launch import cpu_env, free_port
from tests.integration.cli import FAST, metrics

SMALL = [
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
    "rollout.n=2", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=1",
]  # fmt: skip
STEPS = 4


def _comparable(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows}


def _torchrun_cmd(out: Path, nproc: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "megatron_rl.train", f"trainer.output_dir={out}", *FAST,
            *overrides]  # fmt: skip


def train(
    out: Path, *overrides: str, nproc: int = 1, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run to the end in its own session; then SIGKILL what is left of that session (megatron-core's
    checkpoint-writer Manager outlives a SIGKILLed parent and would hold the output pipes open)."""
    cmd = (_torchrun_cmd(out, nproc, *overrides) if nproc > 1 else
           [sys.executable, "-m", "megatron_rl.train", f"trainer.output_dir={out}", *FAST, *overrides])  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(out.parent / f"{out.name}.stdout", "w+") as so,
        open(out.parent / f"{out.name}.stderr", "w+") as se,
    ):
        proc = subprocess.Popen(cmd, env={**cpu_env(), **(extra_env or {})}, cwd=out.parent, stdout=so, stderr=se,
                                start_new_session=True, text=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=600)
        finally:
            _kill_session(proc.pid)
        so.seek(0), se.seek(0)
        return subprocess.CompletedProcess(cmd, rc, so.read(), se.read())


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and every process below it (its workers run in sessions of their own)."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _kill_session(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pointer(out: Path) -> int | None:
    try:
        return int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    except (OSError, ValueError):
        return None


def _run_and_kill_after_checkpoint(out: Path, step: int, *overrides: str) -> None:
    """Start a world-2 run, SIGKILL every process as soon as checkpoint ``step`` is published."""
    proc = subprocess.Popen(_torchrun_cmd(out, 2, *overrides), env=cpu_env(), cwd=out.parent, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while (_pointer(out) or 0) < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    _kill_tree(proc.pid)
    _, err = proc.communicate(timeout=60)
    assert (_pointer(out) or 0) >= step, f"the run never wrote checkpoint {step}:\n{err[-4000:]}"


def cut_back(src: Path, dst: Path, step: int) -> None:
    """Copy the finished run ``src`` to ``dst`` as a run stopped right after publishing checkpoint ``step``
    leaves it: the later checkpoints gone, the pointer at ``step``, the metrics up to ``step``. One run that
    saves at ``step`` and after it then serves as the uninterrupted reference and the interrupted run."""
    shutil.copytree(src, dst)
    ckpts = dst / "checkpoints"
    later = [d for d in ckpts.glob("global_step_*") if int(d.name.rsplit("_", 1)[1]) > step]
    assert later and (ckpts / f"global_step_{step}").is_dir(), sorted(p.name for p in ckpts.iterdir())
    for d in later:
        shutil.rmtree(d)
    (ckpts / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    for name in ("metrics.jsonl", "generations.jsonl"):
        if (dst / name).is_file():
            lines = (dst / name).read_text().splitlines()
            (dst / name).write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= step))
    assert sorted(r["step"] for r in metrics(dst)) == list(range(1, step + 1))


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def test_sigkill_after_second_checkpoint_then_restart_matches_uninterrupted(tmp_path):
    """8 prompts, 4 per step: checkpoint 2 sits on the epoch boundary and the restart trains epoch 2."""
    from megatron_rl.tasks.last_digit import _write_split

    _write_split(tmp_path / "train8.parquet", 8, seed=3)
    data = [f"data.train_files={tmp_path / 'train8.parquet'}", "trainer.total_epochs=2"]
    schedule = ["actor.optim.lr_warmup_steps=1", "actor.optim.lr_decay_style=cosine"]  # it resumes too
    args = [*SMALL, *data, *schedule, f"trainer.total_training_steps={STEPS + 2}"]  # epochs end it at STEPS
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    # the uninterrupted reference saves no checkpoint (~1 s a save here): its metrics are those of the same
    # command, so saving changes no metric either
    _check(train(ref_out, *args, "trainer.save_freq=-1", nproc=2))
    _run_and_kill_after_checkpoint(out, 2, *args)
    killed_at = _pointer(out)
    assert killed_at < STEPS, "the run finished before it was killed"
    restarted = train(out, *args, nproc=2)  # the same command
    _check(restarted)
    assert (
        f"resumed from {out / 'checkpoints' / f'global_step_{killed_at}'}"
        in restarted.stdout + restarted.stderr
    )
    ref, got = _comparable(metrics(ref_out)), _comparable(metrics(out))
    assert sorted(got) == list(range(1, STEPS + 1)), "each step must be logged exactly once"
    for step in range(1, STEPS + 1):
        assert got[step] == ref[step], f"step {step} differs after resume:\n{got[step]}\n{ref[step]}"
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == [f"global_step_{STEPS - 1}", f"global_step_{STEPS}", "latest_checkpointed_iteration.txt"]


def test_kill_during_checkpoint_write_resumes_from_previous(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, "trainer.total_training_steps=3", "model.dtype=bfloat16"]  # fp32 main params saved too
    killed = train(out, *args, extra_env={"MEGATRON_RL_TEST_KILL_IN_SAVE": "2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / ".tmp_global_step_2").is_dir() and not (ckpts / "global_step_2").exists()
    assert _pointer(out) == 1
    # A newest directory that looks published but is incomplete (e.g. a torn copy) is skipped too.
    (ckpts / "global_step_2").mkdir()
    (ckpts / "global_step_2" / "state.json").write_text("{")
    restarted = train(out, *args)
    _check(restarted)
    log = restarted.stdout + restarted.stderr
    assert "skipping checkpoint" in log and "global_step_2" in log
    assert f"resumed from {ckpts / 'global_step_1'} (step 1)" in log
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert _pointer(out) == 3 and not (ckpts / ".tmp_global_step_2").exists()
    state = json.loads((ckpts / "global_step_3" / "state.json").read_text())
    assert state["step"] == 3 and state["optimizers"]["actor"]["adam_step"] == 3
