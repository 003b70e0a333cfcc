"""Log-probs and entropy from vocab-parallel (TP-sharded) logits without gathering the vocabulary.

Rank ``r`` of ``tp_group`` holds logits ``[B, T, V/tp]`` for global vocab ids ``[r*V/tp, (r+1)*V/tp)``.
Only ``[B, T]`` tensors cross ranks: the max, the sum of exps, the target logit and (for entropy) the
expected logit are all-reduced. Both functions are custom autograd Functions whose backward is local:
every TP rank computes the same replicated loss, so the gradient for a shard is the shard of the full
gradient (an autograd all-reduce would multiply it by tp). Logits are computed in at least fp32; with
``tp_group`` None or of size 1 no collective runs and the result is ``log_softmax``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(tensor: Tensor, op, group) -> Tensor:
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return logits.to(dtype) / temperature


def _shifted_exp(logits: Tensor, group) -> tuple[Tensor, Tensor, Tensor]:
    """``(logits - global max [B, T, V/tp], exp of it, global sum of exps [B, T])``."""
    global_max = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)  # [B, T]
    shifted = logits - global_max.unsqueeze(-1)  # [B, T, V/tp]
    exp = shifted.exp()
    sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)  # [B, T]
    return shifted, exp, sum_exp


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group) -> Tensor:
        shifted, exp, sum_exp = _shifted_exp(logits, group)
        vocab_local = logits.shape[-1]
        start = 0 if group is None else dist.get_rank(group) * vocab_local
        local_target = target - start  # [B, T]
        in_shard = (local_target >= 0) & (local_target < vocab_local)
        safe_target = torch.where(in_shard, local_target, 0).unsqueeze(-1)  # [B, T, 1]
        target_logit = torch.where(in_shard, shifted.gather(-1, safe_target).squeeze(-1), 0.0)  # [B, T]
        target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), safe_target, in_shard)
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        softmax, safe_target, in_shard = ctx.saved_tensors
        # d logp / d z = onehot(target) - softmax, restricted to this shard.
        grad = softmax.neg()
        grad.scatter_add_(-1, safe_target, in_shard.unsqueeze(-1).to(grad.dtype))
        return grad * grad_output.unsqueeze(-1), None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, group) -> Tensor:
        shifted, exp, sum_exp = _shifted_exp(logits, group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [B, T, V/tp]
        expected = _all_reduce((softmax * shifted).sum(-1), dist.ReduceOp.SUM, group)  # [B, T]
        ctx.save_for_backward(softmax, shifted, expected)
        return sum_exp.log() - expected

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        softmax, shifted, expected = ctx.saved_tensors
        # dH / dz_i = p_i * (E_p[z] - z_i); the global E_p[z] was all-reduced in forward.
        grad = softmax * (expected.unsqueeze(-1) - shifted) * grad_output.unsqueeze(-1)
        return grad, None


def vocab_parallel_log_probs(
    logits: Tensor, target: Tensor, *, tp_group=None, temperature: float = 1.0
) -> Tensor:
    """Log-probs [B, T] of global vocab ids ``target`` [B, T] under ``softmax(logits / temperature)``.

    ``logits``: this rank's vocab shard [B, T, V/tp]. Differentiable with respect to ``logits``.
    A target outside ``[0, V)`` (e.g. a padding id) gives ``-logsumexp`` there instead of an error;
    mask those positions.
    """
    return _VocabParallelLogProb.apply(_scaled(logits, temperature), target, tp_group)


def vocab_parallel_entropy(logits: Tensor, *, tp_group=None, temperature: float = 1.0) -> Tensor:
    """Entropy [B, T] of ``softmax(logits / temperature)`` from the shard ``logits`` [B, T, V/tp].

    Differentiable with respect to ``logits``.
    """
    return _VocabParallelEntropy.apply(_scaled(logits, temperature), tp_group)
