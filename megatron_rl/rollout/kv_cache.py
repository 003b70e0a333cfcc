"""Preallocated KV cache: fixed slots x fixed length, one allocation, freed after generation.

Layout ``[L, 2, S, G/tp, Tmax, D]``: per layer a contiguous ``[S, G/tp, Tmax, D]`` block for keys and one
for values, so the decode step over slots ``0..B-1`` reads a view (no gather). Slots are handed out
lowest-first, which keeps the active slots packed at the front and the CUDA-graph bucket small.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

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


def free_memory_tokens(free: int, cached: int, gpu_memory_utilization: float, per_token: int) -> int:
    """KV-cache tokens that ``gpu_memory_utilization`` of the GPU's free memory holds. ``free``: what the
    driver reports free; ``cached``: bytes the caching allocator reserves but no tensor uses (after an
    update, most of the update's peak), which it hands back when the cache's allocation needs them. Sizing
    from ``free`` alone cut the slots after every update (measured: 512 planned, 208-467 decoded, so the
    step decoded in two or three waves)."""
    return int((free + max(0, cached)) * gpu_memory_utilization) // per_token


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

    The budget is ``kv_cache_tokens`` when set (``rollout.max_num_seqs=auto`` sets it from the memory
    plan), otherwise ``gpu_memory_utilization`` of the free GPU memory, the allocator's unused cached
    blocks included (``free_memory_tokens``; on CPU without a budget, just what the sequences need). Raises ``ValueError`` naming the keys
    when not even one sequence of ``max_len`` tokens fits.
    """
    slots = max(1, min(max_num_seqs, wanted_slots))
    if kv_cache_tokens is not None:
        budget = kv_cache_tokens
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = free_memory_tokens(free, cached, gpu_memory_utilization, per_token)
    else:
        budget = slots * max_len
    if budget < max_len:
        raise ValueError(
            f"The KV cache holds {budget} tokens but the longest prompt plus rollout.max_new_tokens needs "
            f"{max_len}. Raise {KV_KEYS}, shorten the prompts (data.max_prompt_length) or lower "
            f"rollout.max_new_tokens."
        )
    return CachePlan(slots=min(slots, budget // max_len), max_len=max_len, bytes_per_token=per_token)


# 1.5 GiB left free at the driver beside the cache: logits, sampling buffers, CUDA-graph pools. The engine
# no longer empties the allocator's cache every step, so this is what a graph capture can count on (the
# allocator does not release cached blocks while capturing); ``_DecodeState._capture`` empties it first
# where less than this is free.
HEADROOM = 3 << 29


def fits_free(plan: CachePlan, free: int) -> bool:
    """Whether ``plan``'s cache fits ``free`` device bytes with ``HEADROOM`` beside it."""
    return plan.bytes <= free - HEADROOM


def fit_free_memory(plan: CachePlan, free: int, held: int) -> tuple[CachePlan, str | None]:
    """``plan``, or the slots that fit ``free`` device bytes (less ``HEADROOM``) when its cache does not,
    with a note saying so; ``held``: bytes the caching allocator keeps in partly used blocks (they cannot
    take one large tensor). The memory plan counts bytes, not where they lie: on an H200 at the
    Llama-3.1-8B shape it planned 421 slots (39.5 GiB) while 37.5 GiB was free and 9.9 GiB was held in
    fragments, and the allocation died. Fewer slots decode the batch in more waves; the same tokens."""
    room = free - HEADROOM
    per_slot = plan.max_len * plan.bytes_per_token
    if fits_free(plan, free) or room < per_slot:  # fits, or not even one slot: the allocation reports it
        return plan, None
    slots = room // per_slot
    note = (
        f"KV cache: {plan.slots} slots ({plan.bytes / 2**30:.1f} GiB) planned, but {free / 2**30:.1f} GiB of "
        f"device memory is free ({held / 2**30:.1f} GiB more is held by PyTorch's caching allocator in partly "
        f"used blocks): using {slots} slots, so the batch decodes in more waves. "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the default when that variable is not set) avoids such fragmentation; actor.optim.grad_offload=true "
        "frees the gradient buffers while generating; a lower rollout.max_num_seqs silences this."
    )
    return replace(plan, slots=slots), note


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

    def copy_prefix(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first ``length`` positions of slots ``src`` [C] into slots ``dst`` [C] (a shared
        prompt's keys and values), one layer at a time so the temporary is one layer's rows."""
        for layer in self.data:  # [2, S, G/tp, Tmax, D]
            layer[:, dst, :, :length] = layer[:, src, :, :length]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
