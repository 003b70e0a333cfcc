"""Run a worker script under torchrun on CPU (gloo) from a pytest test.

Workers live in ``tests/distributed/workers/``; each runs many checks in one process group so that
processes start once per file, and exits non-zero (with the assertion text on stderr) on failure.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]


_PORTS = random.Random(os.getpid() ^ time.monotonic_ns())  # per process: two pytest workers pick apart


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def free_port() -> int:
    """A free local port for a rendezvous, below the kernel's ephemeral range: a port from ``bind(0)`` is
    ephemeral, released before torchrun binds it, and another test's gloo connections (ephemeral ports)
    could take it in between (EADDRINUSE at the rendezvous, seen once under two pytest workers)."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = _PORTS.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is crowded: an ephemeral one, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(extra: dict | None = None) -> dict:
    """The environment for test subprocesses: CPU only, one thread per rank, the repo importable, no
    inherited launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", WANDB_MODE="offline",
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")  # fmt: skip
    return env | (extra or {})


def torchrun_cmd(nproc: int, *target: str) -> list[str]:
    """``python -m torch.distributed.run`` on a free local port, then ``target`` (a script or ``-m mod``)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", *target]  # fmt: skip


def run_torchrun(worker: str, nproc: int, *args: str, timeout: float = 600, env: dict | None = None):
    """Run ``workers/<worker>`` with ``nproc`` CPU processes; raise with the output on failure."""
    cmd = torchrun_cmd(nproc, str(WORKERS / worker), *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cpu_env(env))
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {worker} (nproc={nproc}) failed with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc
