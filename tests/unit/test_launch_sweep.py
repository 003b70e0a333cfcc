"""A local Hydra multirun sweep writes one output directory per run (hydra.sweep.subdir)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.distributed.launch import cpu_env


def test_two_value_sweep_gives_two_output_dirs(tmp_path):
    # configs/config.yaml numbers each run's dir (hydra.sweep.subdir); its overrides are in .hydra/overrides.yaml.
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "-m", "trainer.total_training_steps=1",
           "actor.optim.lr=1e-3,2e-3", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "trainer.save_final=false"]  # fmt: skip
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
        assert (run / "report.html").is_file() and (
            run / "report" / "score.png"
        ).is_file()  # written at the end
    assert sorted(round(lr, 6) for lr in lrs) == [1e-3, 2e-3]


def test_slurm_launcher_config_composes_with_the_submitit_plugin(tmp_path):
    """configs/hydra/launcher/slurm.yaml is validated against hydra-submitit-launcher's SlurmQueueConf."""
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
           "hydra.launcher.nodes=2", "--cfg", "hydra", "--package", "hydra.launcher"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cpu_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("SlurmLauncher", "partition: gpu", "nodes: 2", "tasks_per_node: 8", "max_num_timeout: 3",
                 "export NCCL_NVLS_ENABLE=0"):  # fmt: skip
        assert line in proc.stdout, (line, proc.stdout)
    bad = subprocess.run(cmd[:4] + ["hydra.launcher.partitions=gpu", "--cfg", "hydra"], capture_output=True,
                         text=True, timeout=300, env=cpu_env(), cwd=tmp_path)  # fmt: skip
    assert bad.returncode != 0 and "partitions" in bad.stderr  # a misspelt launcher key is refused


def test_submitit_sweep_runs_each_point_as_a_submitit_job(tmp_path):
    """The same sweep through submitit (its local executor: what the slurm launcher runs per node, minus
    sbatch): every point is a submitit job with its own output dir."""
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "-m", "hydra/launcher=submitit_local",
           "trainer.dry_run=true", "actor.optim.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           "hydra.launcher.timeout_min=5"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cpu_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (tmp_path / "sweep" / ".submitit").is_dir()  # the jobs went through submitit
    overrides = sorted((tmp_path / "sweep").glob("*/.hydra/overrides.yaml"))
    assert len(overrides) == 2 and {o.parent.parent.name for o in overrides} == {"0", "1"}
    assert sorted("actor.optim.lr=0.001" in o.read_text() for o in overrides) == [False, True]
    assert all((o.parent.parent / "dry_run.json").is_file() for o in overrides)  # each job ran the app
