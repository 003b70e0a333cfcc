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


def _chunk_stats(z: Tensor, group, vocab_start: int, vocab_size: int | None):
    """One chunk of scaled logits z [n, V/tp] (fp32): padding columns masked, then the global max [n],
    sum of exps [n] and expected logit E_p[z] [n]."""
    if vocab_size is not None and vocab_start + z.shape[-1] > vocab_size:
        z[:, max(0, vocab_size - vocab_start) :] = _PAD_LOGIT
    zmax = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
    shifted = z - zmax[:, None]  # [n, V/tp]
    exp = shifted.exp()
    sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
    expected = _all_reduce((exp * shifted).sum(-1), dist.ReduceOp.SUM, group) / sum_exp
    return shifted, exp, sum_exp, expected


_PAD_LOGIT = -1e30  # finite, so p * z stays 0 (not nan) in the entropy


class _FusedLogProbEntropy(torch.autograd.Function):
    """Log-probs and entropy of flattened logits [N, V/tp] in chunks of rows; backward recomputes the
    softmax per chunk from the saved input instead of keeping [N, V/tp] fp32 temporaries."""

    @staticmethod
    def forward(ctx, logits, target, temperature, group, vocab_size, chunk):
        v_local = logits.shape[-1]
        start = 0 if group is None else dist.get_rank(group) * v_local
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lp, ent = (logits.new_empty(logits.shape[0], dtype=dtype) for _ in range(2))
        for s in range(0, logits.shape[0], chunk):
            z = _scaled(logits[s : s + chunk], temperature)
            shifted, _, sum_exp, expected = _chunk_stats(z, group, start, vocab_size)
            local = target[s : s + chunk] - start
            inside = (local >= 0) & (local < v_local)
            picked = shifted.gather(-1, torch.where(inside, local, 0)[:, None])[:, 0]
            picked = _all_reduce(torch.where(inside, picked, 0.0), dist.ReduceOp.SUM, group)
            lp[s : s + chunk] = picked - sum_exp.log()
            ent[s : s + chunk] = sum_exp.log() - expected
        ctx.save_for_backward(logits, target)
        ctx.cfg = (temperature, group, vocab_size, chunk, start)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, target = ctx.saved_tensors
        temperature, group, vocab_size, chunk, start = ctx.cfg
        grad = torch.empty_like(logits)
        v_local = logits.shape[-1]
        for s in range(0, logits.shape[0], chunk):
            z = _scaled(logits[s : s + chunk], temperature)
            shifted, exp, sum_exp, expected = _chunk_stats(z, group, start, vocab_size)
            p = exp / sum_exp[:, None]  # [n, V/tp]
            g = torch.zeros_like(p)
            if g_lp is not None:
                local = target[s : s + chunk] - start
                inside = (local >= 0) & (local < v_local)
                g -= p * g_lp[s : s + chunk, None]
                g.scatter_add_(
                    -1, torch.where(inside, local, 0)[:, None], (inside * g_lp[s : s + chunk])[:, None]
                )
            if g_ent is not None:
                g += p * (expected[:, None] - shifted) * g_ent[s : s + chunk, None]
            grad[s : s + chunk] = (g / temperature).to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_log_probs_and_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Log-probs of ``target`` [B, T] and entropy [B, T] from the shard ``logits`` [B, T, V/tp] in one pass.

    Memory-lean twin of ``vocab_parallel_log_probs`` + ``vocab_parallel_entropy``: works on
    ``chunk_tokens`` rows at a time in fp32 and recomputes the softmax in backward, so the only
    vocab-sized tensor kept for backward is ``logits`` itself (in its own dtype). Columns with a global id
    >= ``vocab_size`` (padding to a multiple of 128 * TP) are excluded from the softmax.
    """
    b, t, v = logits.shape
    lp, ent = _FusedLogProbEntropy.apply(
        logits.reshape(b * t, v), target.reshape(b * t), temperature, tp_group, vocab_size, chunk_tokens
    )
    return lp.view(b, t), ent.view(b, t)  # [B, T] each
