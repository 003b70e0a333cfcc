"""Run `megatron-rl train` as a user would (subprocess, or torchrun for several ranks) and read its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import cpu_env, torchrun_cmd

FAST = [
    "trainer.logger=[jsonl]",
    "trainer.log_generations_freq=-1",
    "trainer.save_final=false",
    "trainer.write_report=false",
]


def train(
    out: Path, *overrides: str, nproc: int = 1, timeout: float = 900, env: dict | None = None
) -> subprocess.CompletedProcess:
    args = [f"trainer.output_dir={out}", *FAST, *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_rl.cli", "train", *args]
    else:
        cmd = torchrun_cmd(nproc, "-m", "megatron_rl.train", *args)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=cpu_env(env), cwd=out.parent
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def val_scores(rows: list[dict]) -> list[float]:
    return [r["val/score/mean"] for r in rows if "val/score/mean" in r]
