"""SPMD runtime on megatron-core: layout validation, process groups, seeding, CPU/gloo compatibility."""

from megatron_rl.distributed.dims import LayoutError, ParallelDims
from megatron_rl.distributed.runtime import (
    destroy_distributed,
    device,
    init_distributed,
    read_launch_env,
    seed_everything,
)

__all__ = [
    "LayoutError",
    "ParallelDims",
    "destroy_distributed",
    "device",
    "init_distributed",
    "read_launch_env",
    "seed_everything",
]
