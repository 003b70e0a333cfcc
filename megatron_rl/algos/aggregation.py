"""Loss aggregation over tokens and sequences with global denominators.

Every mode is written as ``sum over this micro-batch / global denominator``. Passing the denominators of
the whole optimizer step (all micro-batches, all DP ranks; see ``collective.global_loss_denominators``)
makes the sum of the per-micro-batch losses over micro-batches and ranks exactly the global loss, so
gradients summed over micro-batches and DP ranks do not depend on the layout. Without denominators the
local counts are used (one micro-batch on one rank).

Modes (as verl's ``agg_loss``):
- ``token-mean``: sum of token losses / number of response tokens.
- ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
- ``seq-mean-token-mean``: mean over sequences of each sequence's token mean.
- ``seq-mean-token-sum-norm`` (Dr.GRPO): sum of token losses / (number of sequences * ``seq_len_norm``).
- ``token-sum``: plain sum of token losses (no normalisation: the gradient grows with the token count;
  scale the learning rate accordingly).

Sequences are counted only when their response mask is non-empty, so padding rows never count.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from megatron_rl.algos.masked import masked_sum
from megatron_rl.algos.registry import Registry

Denominator = Tensor | int | float | None


def _local_num_seqs(mask: Tensor) -> Tensor:
    return mask.bool().any(-1).sum()


AGG_MODES: Registry[Callable[..., Tensor]] = Registry("loss_agg_mode")


@AGG_MODES.register("token-mean")
def _token_mean(loss_mat, mask, global_num_tokens, global_num_seqs, seq_len_norm):
    denom = mask.bool().sum().clamp(min=1) if global_num_tokens is None else global_num_tokens
    return masked_sum(loss_mat, mask) / denom


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, global_num_tokens, global_num_seqs, seq_len_norm):
    denom = _local_num_seqs(mask).clamp(min=1) if global_num_seqs is None else global_num_seqs
    return masked_sum(loss_mat, mask) / denom


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, global_num_tokens, global_num_seqs, seq_len_norm):
    seq_len = mask.to(loss_mat.dtype).sum(-1).clamp(min=1)  # [B]
    seq_means = masked_sum(loss_mat, mask, dim=-1) / seq_len  # [B]
    denom = _local_num_seqs(mask).clamp(min=1) if global_num_seqs is None else global_num_seqs
    return seq_means.sum() / denom


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, global_num_tokens, global_num_seqs, seq_len_norm):
    norm = loss_mat.shape[-1] if seq_len_norm is None else seq_len_norm
    denom = _local_num_seqs(mask).clamp(min=1) if global_num_seqs is None else global_num_seqs
    return masked_sum(loss_mat, mask) / (denom * norm)


@AGG_MODES.register("token-sum")
def _token_sum(loss_mat, mask, global_num_tokens, global_num_seqs, seq_len_norm):
    return masked_sum(loss_mat, mask)


LOSS_AGG_MODES = AGG_MODES.names()


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: Denominator = None,
    global_num_seqs: Denominator = None,
    seq_len_norm: float | None = None,
) -> Tensor:
    """Aggregate token losses ``loss_mat`` [B, T] over ``loss_mask`` [B, T] into a scalar.

    ``global_num_tokens`` / ``global_num_seqs``: response tokens / non-empty sequences of the whole
    optimizer step (None: this batch's). ``seq_len_norm``: the constant of ``seq-mean-token-sum-norm``
    (None: ``T``); keep it fixed (e.g. the maximum response length) for layout-invariant gradients.
    """
    return AGG_MODES.get(loss_agg_mode)(loss_mat, loss_mask, global_num_tokens, global_num_seqs, seq_len_norm)
