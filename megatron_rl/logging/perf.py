"""Step throughput and the actor update's MFU (``perf/throughput``, ``perf/mfu``)."""

from __future__ import annotations

import torch

PEAK_BF16_FLOPS = 790e12  # H200 dense bf16, the reference the benchmarks use


def actor_params(args) -> int:
    """Parameter count N of a model with ``ModelArgs`` ``args``, from the shape (the 6N-per-token training
    estimate; attention's T^2 term is left out, as in the usual MFU convention)."""
    a = args
    attn = a.hidden_size * (a.num_attention_heads + 2 * a.num_query_groups) * a.head_dim
    attn += a.num_attention_heads * a.head_dim * a.hidden_size
    return a.num_layers * (attn + 3 * a.hidden_size * a.ffn_hidden_size) + a.vocab_size * a.hidden_size


def step_perf(
    tokens: torch.Tensor, seconds: float, update_s: float, *, world_size: int, num_params: int, epochs: int
) -> dict[str, float]:
    """perf/throughput: prompt+response tokens per second per GPU over the step; perf/mfu: the actor
    update's model FLOPs utilisation against the H200's dense bf16 peak (GPU runs only).

    ``tokens``: the step's prompt+response token count over all DP ranks (already reduced)."""
    per_gpu = float(tokens) / max(seconds, 1e-9) / world_size
    out = {"perf/throughput": per_gpu}
    if torch.cuda.is_available():
        flops = 6 * num_params * float(tokens) * epochs / world_size
        out["perf/mfu"] = flops / max(update_s, 1e-9) / PEAK_BF16_FLOPS
    return out
