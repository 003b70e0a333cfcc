"""A collective that times out surfaces as an error naming the phase and the rank, not a silent hang."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from megatron_rl.distributed.phase_watchdog import CollectiveTimeout, is_timeout, phase
from tests.distributed.launch import REPO, free_port


def test_phase_renames_timeouts_only():
    with pytest.raises(
        CollectiveTimeout, match=r"rank 0: a collective in phase 'update_actor' timed out after 2 min"
    ):
        with phase("update_actor", 2):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Timed out waiting 120000ms for recv")
    with pytest.raises(ValueError, match="unrelated"):
        with phase("gen"):
            raise ValueError("unrelated")
    assert not is_timeout(RuntimeError("shape mismatch"))


WORKER = textwrap.dedent("""
    import datetime, os, time
    import torch, torch.distributed as dist
    from megatron_rl.distributed.phase_watchdog import phase
    if __name__ == "__main__":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
        if dist.get_rank() == 1:
            time.sleep(8)  # never joins in time: a hung or crashed peer
        else:
            with phase("ref", timeout_minutes=0.05):
                dist.all_reduce(torch.ones(1))
""")


def test_gloo_timeout_names_phase_and_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script)]  # fmt: skip
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "CollectiveTimeout: rank 0: a collective in phase 'ref' timed out after 0.05 min" in proc.stderr


STUCK = textwrap.dedent("""
    import sys, time
    from megatron_rl.distributed.phase_watchdog import phase, set_error_dir
    set_error_dir(sys.argv[1])
    with phase("gen", timeout_minutes=0.05):
        time.sleep(0.5)  # finishes in time: nothing happens
    print("first phase done", flush=True)
    with phase("update_actor", timeout_minutes=0.02):
        time.sleep(30)  # a stuck NCCL collective blocks the host like this, raising nothing
    print("not reached", flush=True)
""")


def test_nccl_style_stuck_phase_ends_the_process_with_a_named_error(tmp_path):
    """NCCL only logs a timed-out collective; the phase monitor turns a phase that outlives
    trainer.timeout_minutes into a named error and a non-zero exit instead of a hang."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "MEGATRON_RL_PHASE_MONITOR": "1",
           "MEGATRON_RL_PHASE_POLL_S": "0.2", "RANK": "0"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert proc.returncode == 3 and "first phase done" in proc.stdout and "not reached" not in proc.stdout
    assert (
        "rank 0: phase 'update_actor' has not finished after 0.02 min (trainer.timeout_minutes)"
        in proc.stderr
    )
    assert "phase 'update_actor'" in (tmp_path / "error_rank0.log").read_text()


NESTED = textwrap.dedent("""
    import subprocess, sys, time
    from megatron_rl.distributed.phase_watchdog import phase
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("child", child.pid, flush=True)
    with phase("val", timeout_minutes=0.02, what="validation"):
        for _ in range(3):
            with phase("gen", timeout_minutes=0.02):
                time.sleep(0.7)  # the outer phase lasts longer than the limit, but no stretch of it does
        print("validation done", flush=True)
        with phase("reward", timeout_minutes=0.02, what="the reward function"):
            time.sleep(60)  # a reward function that never returns: no collective involved
""")


def test_stuck_phase_is_bounded_without_nccl_names_outer_phase_and_ends_children(tmp_path):
    """On by default on every backend (no process group at all here); the clock restarts at each phase
    change; the children of the process end with it."""
    import psutil

    script = tmp_path / "nested.py"
    script.write_text(NESTED)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "MEGATRON_RL_PHASE_POLL_S": "0.2", "RANK": "0"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 3 and "validation done" in proc.stdout, proc.stderr[-2000:]
    assert (
        "rank 0: phase 'reward' has not finished after 0.02 min (trainer.timeout_minutes); it runs the reward "
        "function, inside phase 'val'." in proc.stderr
    )
    child = int(proc.stdout.split("child ")[1].split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
