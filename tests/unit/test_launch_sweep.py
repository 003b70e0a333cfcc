"""A local Hydra multirun sweep writes one output directory per run (hydra.sweep.subdir)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.distributed.launch import cpu_env


def test_two_value_sweep_gives_two_output_dirs(tmp_path):
    # configs/config.yaml numbers each run's dir (hydra.sweep.subdir); its overrides are in .hydra/overrides.yaml.
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "-m", "trainer.total_training_steps=1",
           "actor.optim.lr=1e-3,2e-3", "trainer.test_freq=-1", "trainer.val_before_train=false"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cpu_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    runs = sorted(p.parent for p in tmp_path.glob("multirun/*/*/*/metrics.jsonl"))
    assert len(runs) == 2 and runs[0] != runs[1], runs
    lrs = []
    for run in runs:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1]
        lrs.append(rows[0]["actor/lr"])
        assert (run / ".hydra" / "overrides.yaml").is_file()
    assert sorted(round(lr, 6) for lr in lrs) == [1e-3, 2e-3]
