"""Reading the launch environment from torchrun or slurm variables."""

import warnings

import pytest

from megatron_rl.distributed.runtime import first_slurm_host, read_launch_env


def test_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h1", "MASTER_PORT": "2222"}
    le = read_launch_env(env)
    assert (le.rank, le.world_size, le.local_rank, le.master_addr, le.master_port, le.source) == (
        3,
        8,
        1,
        "h1",
        2222,
        "torchrun",
    )


def test_slurm_env_uses_first_host():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "5",
        "SLURM_NODELIST": "gpu[007-009,012]",
    }
    le = read_launch_env(env)
    assert (le.rank, le.world_size, le.local_rank, le.master_addr, le.source) == (5, 16, 5, "gpu007", "slurm")


def test_single_process_default():
    le = read_launch_env({})
    assert (le.rank, le.world_size, le.source) == (0, 1, "single")


def test_nodelist_forms():
    assert first_slurm_host("node12") == "node12"
    assert first_slurm_host("a[1-3],b7") == "a1"
    assert first_slurm_host("dgx-[04,07-08]") == "dgx-04"


def test_a_lone_process_group_writes_no_rendezvous_variables():
    """The single-process group passes its free port to torch instead of os.environ (a leaked MASTER_PORT
    made later CLI runs collide with the port an in-process group still held: EADDRINUSE in CI)."""
    import os
    import subprocess
    import sys

    code = (
        "import os, torch.distributed as dist\n"
        "from megatron_rl.distributed import init_distributed\n"
        "init_distributed(1, 1, seed=0)\n"
        "assert dist.get_world_size() == 1\n"
        "print(sorted(k for k in os.environ if k.startswith('MASTER_')))\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_expandable_segments_are_the_default_and_a_user_setting_is_kept():
    from megatron_rl.distributed.runtime import ALLOC_CONF, cuda_allocator_defaults

    env: dict[str, str] = {}
    assert cuda_allocator_defaults(env) == ALLOC_CONF
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_GRAPH_REGISTER": "0"}
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env = {key: "expandable_segments:False"}
        with pytest.warns(UserWarning, match=f"{key}=.*expandable_segments:True.*ppo_max_token_len_per_gpu"):
            assert cuda_allocator_defaults(env) is None
        assert env == {key: "expandable_segments:False"}  # the user's choice, and no NCCL key added
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda_allocator_defaults(env) is None
    assert env["NCCL_GRAPH_REGISTER"] == "0"  # expandable segments the user set need it as much
    with warnings.catch_warnings():  # only rank 0 says it
        warnings.simplefilter("error")
        assert (
            cuda_allocator_defaults({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256", "RANK": "3"}) is None
        )
    env = {"NCCL_GRAPH_REGISTER": "1"}
    cuda_allocator_defaults(env)
    assert env["NCCL_GRAPH_REGISTER"] == "1" and env["PYTORCH_CUDA_ALLOC_CONF"] == ALLOC_CONF


def test_a_live_allocator_gets_the_setting_without_a_deprecation_warning(monkeypatch):
    """CUDA already in use (the benchmarks touch it before setup): the setting goes to the live allocator, and
    torch 2.11's FutureWarning about the function's name stays out of the run's log."""
    import os

    import torch

    from megatron_rl.distributed.runtime import ALLOC_CONF, cuda_allocator_defaults

    got = []

    def deprecated(conf):  # as torch 2.11's
        warnings.warn("torch.cuda._set_allocator_settings is deprecated", FutureWarning, stacklevel=2)
        got.append(conf)

    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(key, "")  # restored (to absent, if so) after the test
        monkeypatch.delenv(key)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", deprecated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda_allocator_defaults() == ALLOC_CONF and got == [ALLOC_CONF]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOC_CONF
