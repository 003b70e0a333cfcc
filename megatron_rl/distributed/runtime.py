"""SPMD runtime: process group from torchrun or slurm, megatron-core parallel_state, seeding."""

from __future__ import annotations

import datetime
import os
import random
import re
import socket
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.distributed import cpu_compat
from megatron_rl.distributed.dims import LayoutError, ParallelDims


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, read from torchrun's or slurm's environment (single process if neither)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "single"


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM_NODELIST such as ``node[003-005,010],gpu7`` -> ``node003``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_launch_env(environ: os._Environ | dict | None = None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    port = int(env.get("MASTER_PORT", 29500))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            env.get("MASTER_ADDR", "127.0.0.1"),
            port,
            "torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1"))
        return LaunchEnv(
            int(env["SLURM_PROCID"]),
            int(env["SLURM_NTASKS"]),
            int(env.get("SLURM_LOCALID", 0)),
            addr,
            port,
            "slurm",
        )
    if "MASTER_PORT" not in env:
        port = _free_port()  # a lone process must not collide with another run's default port
    return LaunchEnv(0, 1, 0, "127.0.0.1", port, "single")


def device() -> torch.device:
    """This rank's compute device (its local GPU, or the CPU when CUDA is absent)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch (CPU and CUDA) and megatron-core's model-parallel RNG tracker.

    The tracker gives each TP rank its own stream for TP-sharded init/dropout; DP ranks share the base
    seed, so replicas start identical.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if parallel_state.model_parallel_is_initialized():
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


ALLOC_CONF = "expandable_segments:True"


def cuda_allocator_defaults(env: dict | None = None) -> str | None:
    """Turn on the caching allocator's expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (any
    value, e.g. ``expandable_segments:False``, keeps the user's choice). Returns the setting applied, or None.

    Why: after an update the allocator holds free memory in partly used blocks, so a large tensor (the
    KV cache, a micro-batch's logits) can fail with enough memory free in all. Measured on one H200 (session
    9): Qwen2.5-0.5B at the auto token budget died in the update's log-prob backward asking 19.7 GiB with
    18.7 GiB free and 19.3 GiB reserved but unallocated; with expandable segments the same run peaked at
    123.9 GiB, and Llama-3.1-8B kept all 512 KV slots after each update (482 without). Also sets
    NCCL_GRAPH_REGISTER=0 (unless set): megatron-core asserts it for CUDA graphs with expandable segments
    on pre-Blackwell GPUs (illegal memory access otherwise), and the TP>1 decode graphs hold NCCL calls.
    Must run before CUDA is first used; if it already was, the setting is applied to the live allocator."""
    env = os.environ if env is None else env
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if key in env:
            if "expandable_segments:true" in env[key].replace(" ", "").lower():
                env.setdefault("NCCL_GRAPH_REGISTER", "0")  # the same hazard with the user's own setting
            elif "cudamallocasync" not in env[key].replace(" ", "").lower() and env.get("RANK", "0") == "0":
                warnings.warn(
                    f"{key}={env[key]!r} leaves out expandable_segments:True: the memory plan's auto token "
                    "budgets and KV-cache slots count bytes, not fragments (on one H200 the Qwen2.5-0.5B "
                    "auto budget died asking 19.7 GiB with 19.3 GiB held in partly used blocks). Add "
                    f"expandable_segments:True to {key}, or set actor.ppo_max_token_len_per_gpu lower.",
                    stacklevel=2,
                )
            return None
    env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    env.setdefault("NCCL_GRAPH_REGISTER", "0")
    if env is os.environ and torch.cuda.is_available() and torch.cuda.is_initialized():
        # the same call on every torch this supports; 2.11 warns that it is deprecated (FutureWarning in every
        # device log) while 2.13 only forwards it to ``torch._C._accelerator_setAllocatorSettings``, whose
        # meaning in 2.9-2.10 is not checked here: the old name is kept and its warning silenced
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings(ALLOC_CONF)
    return ALLOC_CONF


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    *,
    seed: int = 1234,
    num_layers: int | None = None,
    sequence_parallel: bool = False,
    timeout_minutes: float = 30.0,
) -> ParallelDims:
    """Join (or create) the process group and build megatron-core's TP/PP/DP groups.

    Validates the layout against the world size before any group is created. May be called again in the
    same process with other sizes: the default group is kept and parallel_state is rebuilt.
    Returns the validated ``ParallelDims``.
    """
    from megatron.core import parallel_state

    launch = read_launch_env()
    dims = ParallelDims.build(launch.world_size, tp, pp, num_layers=num_layers)
    if sequence_parallel and not torch.cuda.is_available():
        raise LayoutError(
            "parallel.sequence_parallel=true needs GPUs (it relies on megatron-core's CUDA kernels); "
            "set parallel.sequence_parallel=false on CPU."
        )
    cpu_compat.apply()
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            cuda_allocator_defaults()
            torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        # torchrun/srun: env:// (torchrun's agent store is reused). A lone process passes its address
        # instead of writing it into os.environ: a port left there by an in-process job (a conversion, a
        # test) would send every later child process to a port this process still holds.
        init = "env://" if launch.source != "single" else f"tcp://{launch.master_addr}:{launch.master_port}"
        if launch.source == "slurm":
            os.environ.setdefault("MASTER_ADDR", launch.master_addr)
            os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            init_method=init,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=int(max(1, timeout_minutes)),
    )
    seed_everything(seed)
    return dims


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
