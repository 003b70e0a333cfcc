"""Run a worker script under torchrun on CPU (gloo) from a pytest test.

Workers live in ``tests/distributed/workers/``; each runs many checks in one process group so that
processes start once per file, and exits non-zero (with the assertion text on stderr) on failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(worker: str, nproc: int, *args: str, timeout: float = 600, env: dict | None = None):
    """Run ``workers/<worker>`` with ``nproc`` CPU processes; raise with the output on failure."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(WORKERS / worker),
        *args,
    ]
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(env or {}),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {worker} (nproc={nproc}) failed with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc
