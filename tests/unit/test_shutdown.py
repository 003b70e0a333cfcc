"""Signals are recorded, not fatal, and agreed on at a step boundary; megatron-core's checkpoint-writer
Manager is ours and ends with its parent, even after a SIGKILL (issue 20, clean stops)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from megatron_rl.distributed.shutdown import EXIT_SIGNALLED
from tests.distributed.launch import REPO

RECORD = textwrap.dedent("""
    import os, signal
    from megatron_rl.distributed.shutdown import agreed_stop, install_stop_handlers
    install_stop_handlers()
    assert agreed_stop() is None
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: recorded, no KeyboardInterrupt
    print("after SIGINT:", agreed_stop(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # recorded, the process goes on
    print("after first:", agreed_stop(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # a second one stops it at once
    print("not reached", flush=True)
""")

ORPHAN = textwrap.dedent("""
    import os, signal
    if __name__ == "__main__":  # the spawned Manager imports this file again: keep that cheap
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron_rl.distributed import shutdown
        shutdown.own_children()
        queue = filesystem_async._get_write_results_queue()  # what megatron-core's writer calls
        queue.put(1)
        assert queue.get() == 1
        os.kill(shutdown._state["manager"]._process.pid, signal.SIGTERM)  # a signal to the whole group...
        queue.put(2)  # ...leaves the queue working
        print("manager", shutdown._state["manager"]._process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
""")


def _env() -> dict:
    return {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1"}


def test_signals_are_recorded_a_second_one_stops_at_once(tmp_path):
    (tmp_path / "record.py").write_text(RECORD)
    proc = subprocess.run([sys.executable, str(tmp_path / "record.py")], capture_output=True, text=True,
                          timeout=60, env=_env())  # fmt: skip
    assert "after SIGINT: SIGINT" in proc.stdout, proc.stderr[-2000:]
    assert "after first: SIGTERM" in proc.stdout and "not reached" not in proc.stdout
    assert proc.returncode == -signal.SIGTERM and EXIT_SIGNALLED not in (0, 1, 2, 3)
    assert "rank 0 got SIGTERM: finishing this step on every rank" in proc.stderr


def test_writer_manager_survives_group_signals_and_ends_with_a_killed_parent(tmp_path):
    (tmp_path / "orphan.py").write_text(ORPHAN)
    proc = subprocess.run([sys.executable, str(tmp_path / "orphan.py")], capture_output=True, text=True,
                          timeout=300, env=_env())  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pid = int(proc.stdout.split("manager ")[1].split()[0])
    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the checkpoint-writer Manager outlived its SIGKILLed parent"
