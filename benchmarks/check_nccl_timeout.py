"""Issue 6: does a stuck NCCL collective become a ``CollectiveTimeout`` naming the phase and rank?

Two GPUs. Rank 1 sleeps inside ``phase("update_actor")`` while rank 0 enters an all-reduce there (process
group timeout ``TMIN`` minutes). Each rank prints what it saw: NAMED (our error), OTHER (another exception)
or nothing (aborted by NCCL's watchdog / hang; the caller's ``timeout`` ends it). Run it once per NCCL
error-handling setting:

    for env in "" TORCH_NCCL_ASYNC_ERROR_HANDLING=2 TORCH_NCCL_BLOCKING_WAIT=1; do
      env $env timeout 60 torchrun --nproc-per-node=2 benchmarks/check_nccl_timeout.py; done
"""

import os
import time

import torch
import torch.distributed as dist

from megatron_rl.distributed import init_distributed
from megatron_rl.distributed.phase_watchdog import CollectiveTimeout, phase

limit = float(os.environ.get("TMIN", "0.15"))
init_distributed(1, 1, seed=0, timeout_minutes=limit)
rank = dist.get_rank()
x = torch.ones(1024, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
t0 = time.time()
try:
    with phase("update_actor", limit):
        if rank == 1:
            time.sleep(float(os.environ.get("SLEEP", "30")))
        dist.all_reduce(x)
        torch.cuda.synchronize()
        float(x[0])
    print(f"rank {rank}: no error after {time.time() - t0:.1f}s", flush=True)
except CollectiveTimeout as e:
    print(f"rank {rank}: NAMED after {time.time() - t0:.1f}s: {str(e)[:300]}", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank {rank}: OTHER {type(e).__name__} after {time.time() - t0:.1f}s: {str(e)[:300]}", flush=True)
os._exit(0)
