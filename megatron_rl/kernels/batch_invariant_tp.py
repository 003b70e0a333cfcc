"""The tensor-parallel exchanges of ``rollout.exact_logprobs``: the pieces ``kernels.batch_invariant``
computes on one rank's shard, combined across the TP group in rank order (never by an all-reduce sum,
whose order NCCL picks by message size), so the trainer's shards and the engine's decoder give the same
bits.

- ``ordered_all_reduce``: a row-parallel linear's partial outputs all-gathered and added in rank order in
  fp32 (``batch_invariant.ordered_sum``); the trainer's exact layers and the decoder's exact path call it.
  ``OrderedAllReduce`` is its differentiable form: the gradient of a replicated sum with respect to each
  rank's partial is the output gradient itself (megatron-core's all-reduce region has the same backward).
- ``vocab_parallel_token_logprobs``: the trainer's log-prob from its vocab shard of the logits: the max
  all-reduced (exact in any order), each shard's sum of exps all-gathered and added in rank order; the
  engine computes the same from its gathered row with ``batch_invariant.token_logprobs(..., shard=V/tp)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.kernels import batch_invariant as bi


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() and group is not None else 1


def _all_gather(x: Tensor, group: dist.ProcessGroup) -> list[Tensor]:
    """x [...] -> every rank's x, in group-rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def ordered_all_reduce(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """x [...] this rank's partial sum -> the group's sum [...] in x's dtype: fp32 adds in rank order, one
    rounding; ``x`` itself on a group of one."""
    if group_size(group) == 1:
        return x
    return bi.ordered_sum(_all_gather(x, group), x.dtype)


class OrderedAllReduce(torch.autograd.Function):
    """``ordered_all_reduce`` forward; backward: the output gradient, unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        return ordered_all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float, vocab_size: int, group: dist.ProcessGroup | None
) -> Tensor:
    """logits [N, V/tp] (this rank's shard of the padded vocab), tokens [N] (global ids) ->
    ``log_softmax(logits / temperature)[token]`` [N] fp32 over the first ``vocab_size`` columns of the
    whole row: the bits of ``batch_invariant.token_logprobs(gathered[:, :vocab_size], tokens, temperature,
    shard=V/tp)``."""
    tp = group_size(group)
    if tp == 1:
        return bi.token_logprobs(logits, tokens, temperature, vocab_size)
    width = logits.shape[-1]
    start = dist.get_rank(group) * width
    valid = min(max(vocab_size - start, 0), width)
    zmax = bi.shard_max(logits, temperature, valid)  # [N]
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack(_all_gather(bi.shard_exp_sum(logits, temperature, valid, zmax), group))  # [tp, N]
    lse = bi.combine_exp_sums(sums)
    local = tokens - start
    inside = (local >= 0) & (local < width)
    picked = logits.gather(-1, local.clamp(0, width - 1)[:, None])[:, 0].float() / temperature  # [N]
    # one rank holds each token: the others add exact zeros, so the sum is that rank's value in any order
    picked = torch.where(inside, picked, torch.zeros_like(picked))
    dist.all_reduce(picked, group=group)
    return picked - zmax - lse
