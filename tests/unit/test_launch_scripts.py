"""launch/: the torchrun and slurm command lines, built with slurm's variables set on this machine."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SLURM_ONE_NODE = {"SLURM_JOB_NODELIST": "gpu-a[007-008]", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242",
                  "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "8"}  # fmt: skip


def _run(script: str, *args: str, env: dict, path_prefix: Path | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full = {
        **base,
        "PATH": f"{path_prefix}{os.pathsep}{base['PATH']}" if path_prefix else base["PATH"],
        **env,
    }
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args], env=full, capture_output=True, text=True, timeout=60
    )


def test_slurm_cmd_one_node_builds_c10d_torchrun():
    out = _run(
        "slurm_cmd.sh", "--dry", "trainer.total_training_steps=3", "actor.optim.lr=1e-6", env=SLURM_ONE_NODE
    )
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert "--nnodes=1" in argv and "--nproc-per-node=8" in argv
    assert "--rdzv-backend=c10d" in argv and "--rdzv-id=4242" in argv
    assert "--rdzv-endpoint=gpu-a007:29500" in argv
    assert argv[-4:] == ["-m", "megatron_rl.train", "trainer.total_training_steps=3", "actor.optim.lr=1e-6"]


def test_slurm_cmd_gpus_per_node_port_and_plain_host():
    env = {**SLURM_ONE_NODE, "SLURM_JOB_NODELIST": "node12", "GPUS_PER_NODE": "2", "MASTER_PORT": "31000"}
    argv = shlex.split(_run("slurm_cmd.sh", "--dry", env=env).stdout)
    assert "--nproc-per-node=2" in argv and "--rdzv-endpoint=node12:31000" in argv


def test_slurm_cmd_outside_slurm_names_the_missing_variable():
    out = _run("slurm_cmd.sh", "--dry", env={})
    assert out.returncode == 2 and "SLURM_JOB_NODELIST is not set" in out.stderr


def test_sbatch_runs_one_srun_task_per_node_with_nccl_env(tmp_path):
    """The sbatch script itself, with a stand-in srun that records its options and runs the task."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(
        '#!/usr/bin/env bash\necho "SRUN $*" ; while [[ "$1" == -* ]]; do shift; done\n'
        'echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE ASYNC=$TORCH_NCCL_ASYNC_ERROR_HANDLING"; exec "$@"\n'
    )
    (fake / "srun").chmod(0o755)
    env = {
        **SLURM_ONE_NODE,
        "LAUNCH_DRY": "1",
        "MEGATRON_RL_HOME": str(tmp_path),
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    (tmp_path / "launch").symlink_to(LAUNCH)
    out = _run("slurm.sbatch", "trainer.save_freq=10", env=env, path_prefix=fake)
    assert out.returncode == 0, out.stderr
    srun_line, env_line, cmd_line = out.stdout.strip().splitlines()
    assert "--ntasks-per-node=1" in srun_line and f"--output={tmp_path}/logs/4242/%N.log" in srun_line
    assert env_line == "NCCL_NVLS_ENABLE=0 ASYNC=1"
    argv = shlex.split(cmd_line)
    assert "--rdzv-endpoint=gpu-a007:29500" in argv and argv[-1] == "trainer.save_freq=10"
    assert (tmp_path / "logs" / "4242").is_dir()


def test_torchrun_sh_passes_overrides_through():
    out = _run(
        "torchrun.sh",
        "algorithm=ppo",
        "trainer.total_training_steps=2",
        env={"NPROC": "4", "LAUNCH_DRY": "1"},
    )
    argv = shlex.split(out.stdout)
    assert "--standalone" in argv and "--nproc-per-node=4" in argv
    assert argv[-4:] == ["-m", "megatron_rl.train", "algorithm=ppo", "trainer.total_training_steps=2"]


def test_hydra_slurm_launcher_config_extends_submitit():
    text = (REPO / "configs" / "hydra" / "launcher" / "slurm.yaml").read_text()
    assert text.startswith("# @package hydra.launcher") and "- submitit_slurm" in text
    assert "hydra-submitit-launcher" in (REPO / "setup.py").read_text()


def test_torchrun_script_uses_the_project_venv_without_activation():
    venv_python = REPO / ".venv" / "bin" / "python"
    env = {"LAUNCH_DRY": "1", "NPROC": "2", "PYTHON": ""}
    argv = shlex.split(_run("torchrun.sh", "algorithm=ppo", env=env).stdout)
    assert argv[0] == (str(venv_python) if venv_python.exists() else "python3")
    assert shlex.split(_run("torchrun.sh", env={**env, "PYTHON": "/opt/py"}).stdout)[0] == "/opt/py"
