"""Policy-gradient losses (registry: PPO clip and GSPO here, the others in ``policy_loss_variants``), the
rollout IS correction hook (``rollout_correction``), and the entropy bonus.

A registered policy loss maps ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask`` [B, T]
(and its own keyword hyper-parameters) to ``(token losses [B, T], metrics)``. ``compute_policy_loss``
adds the optional truncated importance-sampling (TIS) correction against the rollout engine's
log-probs and aggregates with global denominators (see ``aggregation``).

Metrics are detached scalar tensors, means over this batch's response tokens (reduce them across DP
weighted by the local token count): ``pg_clipfrac``, ``pg_clipfrac_lower`` (dual-clip active),
``ppo_kl`` (mean of ``old_log_prob - log_prob``), and ``tis_weight_mean`` / ``tis_clipfrac`` with TIS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megatron_rl.algos.aggregation import Denominator, agg_loss
from megatron_rl.algos.masked import masked_mean
from megatron_rl.algos.registry import Registry
from megatron_rl.algos.rollout_correction import truncated_is_weights

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
_POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = _POLICY_LOSSES.register  # decorator; a name registered twice is an error


def policy_loss_names() -> tuple[str, ...]:
    """Every registered policy loss (the choices of ``actor.policy_loss``)."""
    return _POLICY_LOSSES.names()


def get_policy_loss(name: str) -> PolicyLoss:
    """The token-level policy loss registered as ``name`` (``vanilla``/``ppo``, ``gspo``, ``cispo``...)."""
    return _POLICY_LOSSES.get(name)


def frac(condition: Tensor, mask: Tensor) -> Tensor:
    """Fraction of the response tokens of ``mask`` [B, T] where ``condition`` [B, T] holds (detached)."""
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
        "pg_clipfrac": frac(loss_clipped > loss_unclipped, response_mask),
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
    metrics["pg_clipfrac_lower"] = frac((loss > loss_cap) & negative, response_mask)
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
        "pg_clipfrac": frac(loss_clipped > loss_unclipped, response_mask),
        "pg_clipfrac_lower": torch.zeros((), dtype=torch.float32),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return torch.maximum(loss_unclipped, loss_clipped), metrics


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
    tis_low: float = 0.5,
    is_weights: Tensor | None = None,
    **loss_kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregated policy loss and its metrics.

    ``old_log_prob``, ``log_prob`` (with grad), ``advantages``, ``response_mask``, ``rollout_log_prob``:
    [B, T]. ``loss_kwargs`` go to the registered loss (``clip_ratio_low``, ``clip_ratio_high``,
    ``clip_ratio_c``, ...). ``tis_mode`` None disables the rollout IS correction; ``token`` /
    ``sequence`` / ``icepop`` (see ``rollout_correction``) need ``rollout_log_prob``, unless the weights
    ``is_weights`` [B, T] were computed for the whole batch beforehand (batch-normalised ones).
    Denominators: see ``aggregation.agg_loss``. Returns ``(loss, metrics)`` with ``metrics["pg_loss"]``
    the detached loss.
    """
    token_loss, metrics = get_policy_loss(name)(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        **loss_kwargs,
    )
    if is_weights is not None:
        token_loss = token_loss * is_weights
    elif tis_mode is not None:
        if rollout_log_prob is None:
            raise ValueError(f"tis_mode={tis_mode!r} needs rollout_log_prob; pass it or set tis_mode=None.")
        weights, tis_metrics = truncated_is_weights(
            old_log_prob=old_log_prob,
            rollout_log_prob=rollout_log_prob,
            response_mask=response_mask,
            tis_mode=tis_mode,
            tis_cap=tis_cap,
            tis_low=tis_low,
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
