"""Run `megatron-rl train` as a user would (subprocess, or torchrun for several ranks) and read its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import REPO, free_port

FAST = ["trainer.logger=[jsonl]", "trainer.log_generations_freq=-1"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env.update(
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        WANDB_MODE="offline",
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
    )
    return env


def train(out: Path, *overrides: str, nproc: int = 1, timeout: float = 900) -> subprocess.CompletedProcess:
    args = [f"trainer.output_dir={out}", *FAST, *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_rl.cli", "train", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            "megatron_rl.train",
            *args,
        ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=out.parent)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def val_scores(rows: list[dict]) -> list[float]:
    return [r["val/score/mean"] for r in rows if "val/score/mean" in r]
