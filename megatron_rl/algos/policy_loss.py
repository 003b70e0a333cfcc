"""Policy-gradient losses (registry), truncated importance sampling, and the entropy bonus.

A registered policy loss maps ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask`` [B, T]
(and its own keyword hyper-parameters) to ``(token losses [B, T], metrics)``. ``compute_policy_loss``
adds the optional truncated importance-sampling (TIS) correction against the rollout engine's
log-probs and aggregates with global denominators (see ``aggregation``).

Metrics are detached scalar tensors, means over this batch's response tokens (reduce them across DP
weighted by the local token count): ``pg_clipfrac``, ``pg_clipfrac_lower`` (dual-clip active),
``ppo_kl`` (mean of ``old_log_prob - log_prob``), and ``tis_weight_mean`` / ``tis_clipfrac`` with TIS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megatron_rl.algos.aggregation import Denominator, agg_loss
from megatron_rl.algos.masked import masked_mean

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(*names: str):
    """Decorator adding a token-level policy loss to the registry under ``names``."""

    def wrap(fn: PolicyLoss) -> PolicyLoss:
        for name in names:
            _POLICY_LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str) -> PolicyLoss:
    """The token-level policy loss registered as ``name`` (``vanilla``/``ppo``, ``gspo``)."""
    if name not in _POLICY_LOSSES:
        raise ValueError(f"Unknown policy loss {name!r}; choose one of {', '.join(sorted(_POLICY_LOSSES))}.")
    return _POLICY_LOSSES[name]


def _frac(condition: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(condition.to(torch.float32), mask).detach()


@register_policy_loss("vanilla", "ppo")
def ppo_clip_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token [B, T]; all inputs [B, T].

    The ratio is clipped to ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (clip-higher / DAPO when the
    two differ; ``clip_ratio_high=None`` means symmetric). Dual-clip (Ye et al. 2020): for negative
    advantages the loss is also capped at ``-advantages * clip_ratio_c`` (``clip_ratio_c > 1``; None
    disables it). The log-ratio is clamped to [-20, 20] before ``exp``.
    """
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "pg_clipfrac": _frac(loss_clipped > loss_unclipped, response_mask),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    if clip_ratio_c is None:
        metrics["pg_clipfrac_lower"] = torch.zeros((), dtype=torch.float32)
        return loss, metrics
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}; set it to 3.0 or None."
        )
    loss_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    metrics["pg_clipfrac_lower"] = _frac((loss > loss_cap) & negative, response_mask)
    return torch.where(negative, torch.minimum(loss, loss_cap), loss), metrics


@register_policy_loss("gspo")
def gspo_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float | None = 4e-4,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): the sequence-level ratio ``exp(mean_t log(pi/pi_old))`` clipped.

    All inputs [B, T]. The per-token ratio carries the sequence value with each token's own gradient
    (``log_prob - log_prob.detach() + seq_log_ratio.detach()``, clamped at 10). The paper aggregates with
    ``seq-mean-token-mean``.
    """
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # [B]
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [B, T]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + high)
    metrics = {
        "pg_clipfrac": _frac(loss_clipped > loss_unclipped, response_mask),
        "pg_clipfrac_lower": torch.zeros((), dtype=torch.float32),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return torch.maximum(loss_unclipped, loss_clipped), metrics


def _token_tis_log_weight(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio  # [B, T]


def _sequence_tis_log_weight(log_ratio: Tensor, mask: Tensor) -> Tensor:
    seq = torch.where(mask.bool(), log_ratio, 0.0).sum(-1, keepdim=True)  # [B, 1]
    return seq.expand_as(log_ratio)  # [B, T]


_TIS_MODES = {"token": _token_tis_log_weight, "sequence": _sequence_tis_log_weight}


def truncated_is_weights(
    *,
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    tis_mode: str = "token",
    tis_cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights [B, T] correcting for the rollout engine's sampling distribution.

    ``min(pi_old / pi_rollout, tis_cap)`` per token (``token``), or with the product over the
    sequence's response tokens (``sequence``), computed in log space so it cannot overflow. Detached.
    Inputs [B, T]. Metrics: ``tis_weight_mean``, ``tis_clipfrac`` (fraction of tokens at the cap).
    """
    if tis_mode not in _TIS_MODES:
        raise ValueError(f"Unknown tis_mode {tis_mode!r}; choose one of {', '.join(_TIS_MODES)} or None.")
    log_ratio = torch.where(response_mask.bool(), old_log_prob - rollout_log_prob, 0.0).detach()
    log_weight = _TIS_MODES[tis_mode](log_ratio, response_mask)  # [B, T]
    log_cap = math.log(tis_cap)
    weights = torch.exp(torch.clamp(log_weight, max=log_cap))
    metrics = {
        "tis_weight_mean": masked_mean(weights, response_mask),
        "tis_clipfrac": _frac(log_weight > log_cap, response_mask),
    }
    return weights, metrics


def compute_policy_loss(
    name: str,
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Denominator = None,
    global_num_seqs: Denominator = None,
    seq_len_norm: float | None = None,
    rollout_log_prob: Tensor | None = None,
    tis_mode: str | None = None,
    tis_cap: float = 2.0,
    **loss_kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregated policy loss and its metrics.

    ``old_log_prob``, ``log_prob`` (with grad), ``advantages``, ``response_mask``, ``rollout_log_prob``:
    [B, T]. ``loss_kwargs`` go to the registered loss (``clip_ratio_low``, ``clip_ratio_high``,
    ``clip_ratio_c``). ``tis_mode`` None disables TIS; ``"token"``/``"sequence"`` need
    ``rollout_log_prob``. Denominators: see ``aggregation.agg_loss``. Returns ``(loss, metrics)`` with
    ``metrics["pg_loss"]`` the detached loss.
    """
    token_loss, metrics = get_policy_loss(name)(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        **loss_kwargs,
    )
    if tis_mode is not None:
        if rollout_log_prob is None:
            raise ValueError(f"tis_mode={tis_mode!r} needs rollout_log_prob; pass it or set tis_mode=None.")
        weights, tis_metrics = truncated_is_weights(
            old_log_prob=old_log_prob,
            rollout_log_prob=rollout_log_prob,
            response_mask=response_mask,
            tis_mode=tis_mode,
            tis_cap=tis_cap,
        )
        token_loss = token_loss * weights
        metrics.update(tis_metrics)
    loss = agg_loss(
        token_loss,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        seq_len_norm=seq_len_norm,
    )
    metrics["pg_loss"] = loss.detach()
    return loss, metrics


def compute_entropy_loss(
    *,
    entropy: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Denominator = None,
    global_num_seqs: Denominator = None,
    seq_len_norm: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregated entropy ``entropy`` [B, T] over ``response_mask`` [B, T].

    The actor's loss is ``pg_loss - entropy_coeff * entropy_loss`` (a bonus). Returns
    ``(entropy_loss, {"entropy": token mean of this batch})``.
    """
    loss = agg_loss(
        entropy,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        seq_len_norm=seq_len_norm,
    )
    return loss, {"entropy": masked_mean(entropy.detach(), response_mask)}
