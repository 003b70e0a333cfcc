"""Clipped value (critic) loss, as in PPO / verl's ``compute_value_loss``."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algos.aggregation import Denominator, agg_loss
from megatron_rl.algos.masked import masked_mean


def compute_value_loss(
    *,
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Denominator = None,
    global_num_seqs: Denominator = None,
    seq_len_norm: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``0.5 * max((v - R)^2, (clip(v, v_old +- cliprange_value) - R)^2)`` aggregated over tokens.

    ``vpreds`` (with grad), ``values`` (old values from the rollout), ``returns``, ``response_mask``:
    [B, T]. ``cliprange_value=None`` disables clipping. Returns ``(loss, metrics)`` with ``vf_loss``,
    ``vf_clipfrac`` (tokens where the clipped branch is larger) and ``vpred_mean``.
    """
    loss_unclipped = (vpreds - returns).square()
    if cliprange_value is None:
        loss_clipped = loss_unclipped
    else:
        vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        loss_clipped = (vpred_clipped - returns).square()
    token_loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    loss = agg_loss(
        token_loss,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        seq_len_norm=seq_len_norm,
    )
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(torch.float32), response_mask),
        "vpred_mean": masked_mean(vpreds.detach(), response_mask),
    }
    return loss, metrics
