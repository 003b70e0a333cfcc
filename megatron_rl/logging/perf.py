"""Step throughput and the actor update's MFU (``perf/throughput``, ``perf/mfu``)."""

from __future__ import annotations

import torch

from megatron_rl.models.facts import PEAK_BF16_FLOPS


def step_perf(
    tokens: torch.Tensor, seconds: float, update_s: float, *, world_size: int, num_params: int, epochs: int
) -> dict[str, float]:
    """perf/throughput: prompt+response tokens per second per GPU over the step; perf/mfu: the actor
    update's model FLOPs utilisation against the H200's dense bf16 peak (GPU runs only).

    ``tokens``: the step's prompt+response token count over all DP ranks (already reduced); ``num_params``:
    the N of the 6N-per-trained-token estimate (``ModelArgs.matmul_params()``)."""
    per_gpu = float(tokens) / max(seconds, 1e-9) / world_size
    out = {"perf/throughput": per_gpu}
    if torch.cuda.is_available():
        flops = 6 * num_params * float(tokens) * epochs / world_size
        out["perf/mfu"] = flops / max(update_s, 1e-9) / PEAK_BF16_FLOPS
    return out
