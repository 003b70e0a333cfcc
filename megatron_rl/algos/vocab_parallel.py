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

from megatron_rl.kernels import logprob as logprob_kernel
from megatron_rl.kernels.compile import compile_rows_dynamic, probe


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


_PAD_LOGIT = -1e30  # finite, so p * z stays 0 (not nan) in the entropy


# The three passes of the fused kernel over one chunk of logits x [n, V/tp] (any float dtype). Each reads
# x once; between them only [n] statistics cross TP ranks. Eager, each is a few fp32 [n, V/tp] temporaries;
# under torch.compile (CUDA) each is one fused kernel with no vocab-sized temporary.
def _scaled_masked(x: Tensor, temperature: float, valid: int) -> Tensor:
    """fp32 x / temperature with the padding columns (local index >= valid) set to _PAD_LOGIT."""
    z = x.to(torch.promote_types(x.dtype, torch.float32)) / temperature
    if valid < x.shape[-1]:
        col = torch.arange(x.shape[-1], device=x.device)
        z = torch.where(col < valid, z, _PAD_LOGIT)
    return z


def _pass_max(x: Tensor, temperature: float, valid: int) -> Tensor:
    """Row max [n] of the scaled, padding-masked logits."""
    return _scaled_masked(x, temperature, valid).amax(dim=-1)


def _pass_sums(x: Tensor, zmax: Tensor, local: Tensor, inside: Tensor, temperature: float, valid: int):
    """With the global max: local sum of exps [n], local sum of exp * shifted [n] and the shifted target
    logit [n] (0 where the target is in another rank's shard)."""
    shifted = _scaled_masked(x, temperature, valid) - zmax[:, None]
    exp = shifted.exp()
    picked = shifted.gather(-1, local[:, None])[:, 0]
    return exp.sum(-1), (exp * shifted).sum(-1), torch.where(inside, picked, 0.0)


def _pass_grad(x, zmax, log_sum_exp, expected, local, inside, g_lp, g_ent, temperature: float, valid: int):
    """d(lp.g_lp + ent.g_ent)/dx in x's dtype: ((onehot - p) g_lp + p (E_p[z] - z) g_ent) / temperature."""
    shifted = _scaled_masked(x, temperature, valid) - zmax[:, None]
    p = (shifted - log_sum_exp[:, None]).exp()
    g = p * ((expected[:, None] - shifted) * g_ent[:, None] - g_lp[:, None])
    col = torch.arange(x.shape[-1], device=x.device)
    g = g + torch.where((col[None, :] == local[:, None]) & inside[:, None], g_lp[:, None], 0.0)
    return (g / temperature).to(x.dtype)


_COMPILED = {"max": compile_rows_dynamic(_pass_max), "sums": compile_rows_dynamic(_pass_sums),
             "grad": compile_rows_dynamic(_pass_grad)}  # fmt: skip
_PROBE = "the log-prob kernel"


def _kernels(logits: Tensor):
    """The three passes, compiled where ``kernels.compile`` allows and the probe succeeded."""
    if not _compiled_ok(logits):
        return _pass_max, _pass_sums, _pass_grad
    return _COMPILED["max"], _COMPILED["sums"], _COMPILED["grad"]


def _compiled_ok(logits: Tensor) -> bool:
    return probe(_PROBE, logits.device, lambda: _trial(logits[:2].detach()))


def _trial(x: Tensor) -> None:
    """The compiled passes once on two rows of real logits (compile errors surface here, not
    mid-training)."""
    n, v = x.shape
    idx = torch.zeros(n, dtype=torch.long, device=x.device)
    inside = torch.ones(n, dtype=torch.bool, device=x.device)
    m = _COMPILED["max"](x, 1.0, v)
    s0, s1, _ = _COMPILED["sums"](x, m, idx, inside, 1.0, v)
    _COMPILED["grad"](x, m, s0.log(), s1 / s0, idx, inside, s0, s0, 1.0, v)


class _FusedLogProbEntropy(torch.autograd.Function):
    """Log-probs and entropy of flattened logits [N, V/tp] in chunks of rows. Forward keeps three [N]
    statistics per row (global max, log-sum-exp, expected shifted logit); backward reads the saved logits
    once more and writes the gradient, so no fp32 [N, V/tp] tensor lives across forward and backward."""

    @staticmethod
    def forward(ctx, logits, target, temperature, group, vocab_size, chunk):
        n_rows, v_local = logits.shape
        start = 0 if group is None else dist.get_rank(group) * v_local
        valid = v_local if vocab_size is None else max(0, min(v_local, vocab_size - start))
        local = target - start
        inside = (local >= 0) & (local < v_local)
        local = torch.where(inside, local, 0)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        ctx.triton = logprob_kernel.usable(logits)
        if ctx.triton:  # one read of the logits for all three statistics (kernels.logprob)
            zmax, sums = _triton_stats(logits, local, inside, temperature, valid, group)
            return _finish_forward(
                ctx, logits, local, inside, zmax, sums, (temperature, valid, n_rows), dtype
            )
        if _compiled_ok(logits):  # fused kernels keep no temporaries: one chunk, no copies
            chunk = max(n_rows, 1)
        k_max, k_sums, _ = _kernels(logits)
        zmax = torch.empty(n_rows, dtype=dtype, device=logits.device)
        sums = torch.empty(3, n_rows, dtype=dtype, device=logits.device)
        for s in range(0, n_rows, chunk):
            zmax[s : s + chunk] = k_max(logits[s : s + chunk], temperature, valid)
        _all_reduce(zmax, dist.ReduceOp.MAX, group)
        for s in range(0, n_rows, chunk):
            e = slice(s, s + chunk)
            out = k_sums(logits[e], zmax[e], local[e], inside[e], temperature, valid)
            for i, o in enumerate(out):
                sums[i, e] = o
        _all_reduce(sums, dist.ReduceOp.SUM, group)  # sum of exps, sum of exp * shifted, target logit
        return _finish_forward(ctx, logits, local, inside, zmax, sums, (temperature, valid, chunk), dtype)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, local, inside, zmax, log_sum_exp, expected = ctx.saved_tensors
        temperature, valid, chunk = ctx.cfg
        zeros = torch.zeros_like(zmax)
        g_lp = zeros if g_lp is None else g_lp.to(zeros.dtype).contiguous()
        g_ent = zeros if g_ent is None else g_ent.to(zeros.dtype).contiguous()
        if ctx.triton:
            local = torch.where(inside, local, -1)  # -1: the target is in another rank's shard
            grad = logprob_kernel.grad(
                logits, zmax, log_sum_exp, expected, local, g_lp, g_ent, temperature, valid
            )
            return grad, None, None, None, None, None
        _, _, k_grad = _kernels(logits)
        if chunk >= logits.shape[0]:
            args = (zmax, log_sum_exp, expected, local, inside, g_lp, g_ent, temperature, valid)
            return k_grad(logits, *args), None, None, None, None, None
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            e = slice(s, s + chunk)
            grad[e] = k_grad(logits[e], zmax[e], log_sum_exp[e], expected[e], local[e], inside[e],
                             g_lp[e], g_ent[e], temperature, valid)  # fmt: skip
        return grad, None, None, None, None, None


def _triton_stats(logits, local, inside, temperature: float, valid: int, group) -> tuple[Tensor, Tensor]:
    """The global max [N] and the three all-reduced sums [3, N] of ``_FusedLogProbEntropy.forward`` from the
    Triton row statistics: this shard's (max, sums relative to it), moved to the global max and summed."""
    m, s, t = logprob_kernel.row_stats(logits, temperature, valid)
    zmax = _all_reduce(m.clone(), dist.ReduceOp.MAX, group)
    zmax = torch.where(zmax == float("-inf"), 0.0, zmax)  # a row with no valid column on any rank
    s, t = logprob_kernel.combine(m[:, None], s[:, None], t[:, None], zmax)
    picked = logits.gather(-1, local[:, None])[:, 0].float() / temperature
    picked = torch.where(local < valid, picked, _PAD_LOGIT) - zmax  # a padding column: as the eager passes
    sums = torch.stack([s, t, torch.where(inside, picked, 0.0)])
    return zmax, _all_reduce(sums, dist.ReduceOp.SUM, group)


def _finish_forward(ctx, logits, local, inside, zmax, sums, cfg, dtype) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy [N] from the global max and sums; saves what backward reads."""
    log_sum_exp = sums[0].log()
    expected = sums[1] / sums[0]
    ctx.save_for_backward(logits, local, inside, zmax, log_sum_exp, expected)
    ctx.cfg = cfg
    return (sums[2] - log_sum_exp).to(dtype), (log_sum_exp - expected).to(dtype)


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
