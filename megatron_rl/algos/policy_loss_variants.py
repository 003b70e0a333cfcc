"""Policy losses beyond PPO clipping, registered next to ``vanilla``/``gspo`` (see ``policy_loss``).

Each maps ``old_log_prob``, ``log_prob`` (with grad), ``advantages``, ``response_mask`` [B, T] and its own
keyword hyper-parameters to ``(token losses [B, T], metrics)``; ``compute_policy_loss`` aggregates.
The shared keywords ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c`` keep their PPO meaning
unless a docstring says otherwise (DPPO reads them as divergence thresholds, GMPO in log space).

- ``cispo`` (MiniMax-M1, arXiv:2506.13585): clipped, detached IS weight times the REINFORCE term.
- ``sapo`` (Gao et al. 2025, arXiv:2511.20347): a smooth sigmoid gate replaces the hard clip.
- ``geo_mean`` (GMPO, Zhao et al. 2025, arXiv:2507.20673): geometric mean of token ratios per sequence.
- ``clip_cov`` / ``kl_cov`` (Cui et al. 2025, arXiv:2505.22617): detach or KL-penalise the few tokens with
  the largest covariance between advantage and log-prob, which drive entropy collapse.
- ``dppo_tv`` / ``dppo_kl`` (arXiv:2602.04879): trust region on the probability change (total variation
  or binary KL) instead of the ratio.
- ``gpg`` (Chu et al. 2025, arXiv:2504.02546): plain policy gradient ``-A log pi`` (no ratio, no clip).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron_rl.algos.masked import masked_mean
from megatron_rl.algos.policy_loss import frac, register_policy_loss

Metrics = dict[str, Tensor]


def _log_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # [B, T]; exp cannot overflow


def _kl_metric(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(-log_ratio, mask).detach()


def _zero() -> Tensor:
    return torch.zeros((), dtype=torch.float32)


@register_policy_loss("cispo")
def cispo_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    **_: Any,
) -> tuple[Tensor, Metrics]:
    """CISPO: ``-sg(clip(ratio, 1 - low, 1 + high)) * A * log_prob`` per token; all inputs [B, T].

    Unlike PPO no token loses its gradient: clipping only bounds the (detached) IS weight.
    """
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + high)
    loss = -clipped.detach() * advantages * log_prob
    metrics = {
        "pg_clipfrac": frac(clipped != ratio, response_mask),
        "pg_clipfrac_lower": _zero(),
        "ppo_kl": _kl_metric(log_ratio, response_mask),
    }
    return loss, metrics


@register_policy_loss("sapo")
def sapo_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **_: Any,
) -> tuple[Tensor, Metrics]:
    """SAPO: ``-A * sigmoid(tau * (ratio - 1)) * 4 / tau`` per token, ``tau = tau_pos`` where ``A > 0``
    else ``tau_neg``; all inputs [B, T]. The gate has slope 1 at ratio 1 (the policy gradient) and
    fades smoothly away from it; the paper aggregates with ``seq-mean-token-mean``."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    tau = torch.full_like(ratio, tau_neg).masked_fill(advantages > 0, tau_pos)  # in the ratio's dtype
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    metrics = {
        "pg_clipfrac": _zero(),
        "pg_clipfrac_lower": _zero(),
        "ppo_kl": _kl_metric(log_ratio, response_mask),
    }
    return -gate * advantages, metrics


@register_policy_loss("geo_mean", "gmpo")
def gmpo_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    **_: Any,
) -> tuple[Tensor, Metrics]:
    """GMPO: per sequence ``-mean_t(A) * exp(mean_t clip(log ratio))``, the geometric mean of the token
    ratios, each log-ratio clipped to ``[-clip_ratio_low, clip_ratio_high]`` (log space) on the side
    that matters for the sign of A. All inputs [B, T]. The sequence loss is placed on every response
    token, so ``seq-mean-token-mean`` aggregation gives the paper's mean over sequences."""
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [B, T]
    seq_ratio = torch.exp(torch.clamp(masked_mean(pessimistic, response_mask, dim=-1), max=20.0))  # [B]
    seq_adv = masked_mean(advantages, response_mask, dim=-1)  # [B]
    loss = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(log_prob)  # [B, T]
    clipped = clamped != log_ratio
    metrics = {
        "pg_clipfrac": frac(clipped & (advantages > 0), response_mask),
        "pg_clipfrac_lower": frac(clipped & (advantages < 0), response_mask),
        "ppo_kl": _kl_metric(log_ratio, response_mask),
    }
    return loss, metrics


def _random_subset(candidates: Tensor, count: Tensor, generator: torch.Generator | None) -> Tensor:
    """A uniformly random subset of ``count`` (at most) of the True entries of ``candidates`` [B, T]."""
    keys = torch.rand(candidates.shape, generator=generator, dtype=torch.float64).to(candidates.device)
    keys = torch.where(candidates, keys, 2.0)  # non-candidates rank last
    ranks = torch.empty_like(keys, dtype=torch.long).view(-1)
    ranks[keys.view(-1).argsort()] = torch.arange(keys.numel(), device=keys.device)
    return candidates & (ranks.view_as(keys) < count)


def _top_subset(scores: Tensor, valid: Tensor, count: Tensor) -> Tensor:
    """The ``count`` valid entries of ``scores`` [B, T] with the largest values (ties: first in order)."""
    keys = torch.where(valid, scores, -torch.inf)
    order = torch.argsort(keys.reshape(-1), descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel(), device=order.device)
    return valid & (ranks.view_as(keys) < count)


def _covariance(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """Per-token centred product (A - mean A)(log pi - mean log pi) over the batch's response tokens."""
    a, lp = advantages.detach(), log_prob.detach()
    return (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))  # [B, T]


def _num_selected(ratio: float, mask: Tensor) -> Tensor:
    return torch.floor(ratio * mask.bool().sum()).clamp(min=1)


@register_policy_loss("clip_cov")
def clip_cov_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **_: Any,
) -> tuple[Tensor, Metrics]:
    """Clip-Cov: the PPO clipped loss, with the gradient removed from a random ``clip_cov_ratio`` of the
    response tokens (at least one) among those not already clipped whose covariance lies in
    ``(clip_cov_lb, clip_cov_ub)``. All inputs [B, T]; ``generator`` draws the subset."""
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + high)
    keep = response_mask.bool()
    cov = _covariance(advantages, log_prob, response_mask)
    candidates = keep & ~(loss_clipped > loss_unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    detached = _random_subset(candidates, _num_selected(clip_cov_ratio, response_mask), generator)
    loss = torch.where(detached, 0.0, torch.maximum(loss_unclipped, loss_clipped))
    metrics = {
        "pg_clipfrac": frac(loss_clipped > loss_unclipped, response_mask),
        "pg_clipfrac_lower": _zero(),
        "pg_covfrac": frac(detached, response_mask),
        "ppo_kl": _kl_metric(log_ratio, response_mask),
    }
    return loss, metrics


@register_policy_loss("kl_cov")
def kl_cov_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    **_: Any,
) -> tuple[Tensor, Metrics]:
    """KL-Cov: the unclipped surrogate ``-A * ratio``, plus ``ppo_kl_coef * |log ratio|`` on the
    ``kl_cov_ratio`` of response tokens (at least one) with the largest covariance. All inputs [B, T]."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    loss = -advantages * torch.exp(log_ratio)
    cov = _covariance(advantages, log_prob, response_mask)
    penalised = _top_subset(cov, response_mask.bool(), _num_selected(kl_cov_ratio, response_mask))
    loss = torch.where(penalised, loss + ppo_kl_coef * log_ratio.abs(), loss)
    metrics = {
        "pg_clipfrac": _zero(),
        "pg_clipfrac_lower": _zero(),
        "pg_covfrac": frac(penalised, response_mask),
        "ppo_kl": _kl_metric(log_ratio, response_mask),
    }
    return loss, metrics


def _binary_tv_valid(p: Tensor, q: Tensor, low: float, high: float, positive: Tensor) -> Tensor:
    return torch.where(positive, p - q <= high, p - q >= -low)


def _binary_kl_valid(p: Tensor, q: Tensor, low: float, high: float, positive: Tensor) -> Tensor:
    eps = 1e-8
    kl = q * (torch.log(q + eps) - torch.log(p + eps)) + (1 - q) * torch.log((1 - q + eps) / (1 - p + eps))
    return torch.where(positive, (kl <= high) | (p <= q), (kl <= low) | (p >= q))


def _dppo(valid_fn, old_log_prob, log_prob, advantages, response_mask, low, high, clip_c):
    high = low if high is None else high
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=clip_c).detach()
    p, q = torch.exp(log_prob.detach()), torch.exp(old_log_prob)
    valid = valid_fn(p, q, low, high, advantages > 0)  # [B, T]: inside the trust region
    loss = torch.where(valid, -advantages * truncated * log_prob, 0.0)
    metrics = {
        "pg_clipfrac": frac(~valid, response_mask),
        "pg_clipfrac_lower": frac(valid & (ratio > clip_c), response_mask),
        "ppo_kl": _kl_metric(log_ratio, response_mask),
    }
    return loss, metrics


@register_policy_loss("dppo_tv")
def dppo_tv_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    **_: Any,
) -> tuple[Tensor, Metrics]:
    """DPPO-Binary-TV: ``-A * sg(min(ratio, clip_ratio_c)) * log_prob`` on tokens inside the trust region,
    0 elsewhere. The region bounds the probability change ``pi - pi_old``: at most ``clip_ratio_high``
    up where ``A > 0``, at most ``clip_ratio_low`` down otherwise. All inputs [B, T]."""
    cap = 20.0 if clip_ratio_c is None else clip_ratio_c
    return _dppo(
        _binary_tv_valid,
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low,
        clip_ratio_high,
        cap,
    )


@register_policy_loss("dppo_kl")
def dppo_kl_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    **_: Any,
) -> tuple[Tensor, Metrics]:
    """DPPO-Binary-KL: as ``dppo_tv`` with the region ``KL(Bern(pi_old) || Bern(pi)) <= clip_ratio_high``
    for moves up where ``A > 0`` (``<= clip_ratio_low`` for moves down where ``A <= 0``); moves in the
    other direction are always inside. All inputs [B, T]."""
    cap = 20.0 if clip_ratio_c is None else clip_ratio_c
    return _dppo(
        _binary_kl_valid,
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low,
        clip_ratio_high,
        cap,
    )


@register_policy_loss("gpg")
def gpg_loss(
    *, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, **_: Any
) -> tuple[Tensor, Metrics]:
    """GPG: ``-A * log_prob`` per token (inputs [B, T]); pair with ``algorithm.adv_estimator=gpg``."""
    log_ratio = log_prob.detach() - old_log_prob
    metrics = {
        "pg_clipfrac": _zero(),
        "pg_clipfrac_lower": _zero(),
        "ppo_kl": _kl_metric(log_ratio, response_mask),
    }
    return -advantages * log_prob, metrics
