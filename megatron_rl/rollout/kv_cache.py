"""Preallocated KV cache: fixed slots x fixed length, one allocation, freed after generation.

Layout ``[L, 2, S, G/tp, Tmax, D]``: per layer a contiguous ``[S, G/tp, Tmax, D]`` block for keys and one
for values, so the decode step over slots ``0..B-1`` reads a view (no gather). Slots are handed out
lowest-first, which keeps the active slots packed at the front and the CUDA-graph bucket small.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

KV_KEYS = "rollout.kv_cache_tokens / rollout.gpu_memory_utilization"


@dataclass(frozen=True)
class CachePlan:
    """How many sequences fit: ``slots`` sequences of up to ``max_len`` tokens each."""

    slots: int
    max_len: int
    bytes_per_token: int

    @property
    def bytes(self) -> int:
        return self.slots * self.max_len * self.bytes_per_token


def bytes_per_token(num_layers: int, local_groups: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * local_groups * head_dim * torch.empty((), dtype=dtype).element_size()


def plan_cache(
    *,
    max_len: int,
    wanted_slots: int,
    max_num_seqs: int,
    per_token: int,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
    device: torch.device,
) -> CachePlan:
    """Choose the slot count: at most ``max_num_seqs`` and the sequences to run, within the token budget.

    The budget is ``kv_cache_tokens`` when set, otherwise ``gpu_memory_utilization`` of the free GPU
    memory (on CPU without a budget, just what the sequences need). Raises ``ValueError`` naming the keys
    when not even one sequence of ``max_len`` tokens fits.
    """
    slots = max(1, min(max_num_seqs, wanted_slots))
    if kv_cache_tokens is not None:
        budget = kv_cache_tokens
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_utilization) // per_token
    else:
        budget = slots * max_len
    if budget < max_len:
        raise ValueError(
            f"The KV cache holds {budget} tokens but the longest prompt plus rollout.max_new_tokens needs "
            f"{max_len}. Raise {KV_KEYS}, shorten the prompts (data.max_prompt_length) or lower "
            f"rollout.max_new_tokens."
        )
    return CachePlan(slots=min(slots, budget // max_len), max_len=max_len, bytes_per_token=per_token)


class KVCache:
    """The cache tensor plus a lowest-first free-slot allocator."""

    def __init__(self, plan: CachePlan, num_layers: int, local_groups: int, head_dim: int, dtype, device):
        self.plan = plan
        # zeros, not empty: masked positions still enter SDPA as 0 * value, so NaN garbage would poison it
        self.data = torch.zeros(  # [L, 2, S, G/tp, Tmax, D]
            num_layers, 2, plan.slots, local_groups, plan.max_len, head_dim, dtype=dtype, device=device
        )
        self._free = list(range(plan.slots))
        heapq.heapify(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
