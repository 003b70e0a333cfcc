"""Rollout/training mismatch: importance weights, rejection sampling and off-policy diagnostics.

The rollout engine samples from pi_rollout (its own kernels, maybe another precision); the update
treats the samples as drawn from pi_old (the training recompute). Everything here is a function of the
per-token log-ratio ``log pi_old - log pi_rollout`` over the response tokens. Detached; pure.

- IS weight modes (``actor.tis_mode``): ``token`` / ``sequence`` truncated IS (TIS, Yao et al. 2025:
  ``min(ratio, tis_cap)``, the ratio of a token or the product over the sequence) and ``icepop``
  (Ling team, Ring-1T, arXiv:2510.18855: the token ratio where it lies in ``[tis_low, tis_cap]``, 0
  outside, so tokens the two engines disagree on give no gradient at all).
- Batch normalisation of the weights to mean 1 (``actor.tis_batch_normalize``): ``is_weight_moments``
  gives the sums a DP group all-reduces, ``normalize_is_weights`` divides by the global mean.
- Rejection sampling (``actor.rollout_rs``): drop tokens (``token``) or whole sequences whose sum
  (``seq_sum``: the sequence's IS ratio), mean (``seq_mean``: its geometric mean) or most extreme token
  (``seq_max``) log-ratio leaves ``[log rollout_rs_low, log rollout_rs_high]``.
- Diagnostics (as verl's rollout-correction metrics): effective sample size, chi-square divergences,
  training and rollout perplexities; ``off_policy_moments`` gives all-reducible sums and
  ``off_policy_metrics`` the final values, so the DP-reduced result is the global one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_rl.algos.masked import masked_mean, masked_sum
from megatron_rl.algos.registry import Registry

SAFETY_BOUND = 20.0  # |log-ratio| clamp before exp

IS_MODES: Registry[Callable[..., tuple[Tensor, Tensor]]] = Registry("tis_mode")
REJECTION_MODES: Registry[Callable[..., Tensor]] = Registry("rollout_rs mode")


def _log_ratio(old_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), old_log_prob - rollout_log_prob, 0.0).detach()  # [B, T]


@IS_MODES.register("token")
def _token_tis(log_ratio: Tensor, mask: Tensor, cap: float, low: float) -> tuple[Tensor, Tensor]:
    log_cap = math.log(cap)
    return torch.exp(torch.clamp(log_ratio, max=log_cap)), log_ratio > log_cap


@IS_MODES.register("sequence")
def _sequence_tis(log_ratio: Tensor, mask: Tensor, cap: float, low: float) -> tuple[Tensor, Tensor]:
    seq = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)  # [B, T]
    log_cap = math.log(cap)
    return torch.exp(torch.clamp(seq, max=log_cap)), seq > log_cap


@IS_MODES.register("icepop")
def _icepop(log_ratio: Tensor, mask: Tensor, cap: float, low: float) -> tuple[Tensor, Tensor]:
    outside = (log_ratio > math.log(cap)) | (log_ratio < math.log(low))
    weights = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    return torch.where(outside, 0.0, weights), outside


def truncated_is_weights(
    *,
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    tis_mode: str = "token",
    tis_cap: float = 2.0,
    tis_low: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights [B, T] (detached) for the rollout/training mismatch; inputs [B, T].

    ``tis_mode``: ``token`` / ``sequence`` (truncated at ``tis_cap``) or ``icepop`` (0 outside
    ``[tis_low, tis_cap]``). Computed in log space. Metrics: ``tis_weight_mean`` and ``tis_clipfrac``
    (fraction of tokens at the cap, or masked by IcePop).
    """
    if not 0 < tis_low <= 1 <= tis_cap:
        raise ValueError(
            f"TIS bounds need 0 < tis_low <= 1 <= tis_cap, got tis_low={tis_low}, tis_cap={tis_cap}."
        )
    log_ratio = _log_ratio(old_log_prob, rollout_log_prob, response_mask)
    weights, clipped = IS_MODES.get(tis_mode)(log_ratio, response_mask, tis_cap, tis_low)
    metrics = {
        "tis_weight_mean": masked_mean(weights, response_mask),
        "tis_clipfrac": masked_mean(clipped.to(torch.float32), response_mask),
    }
    return weights, metrics


def is_weight_moments(weights: Tensor, response_mask: Tensor, tis_mode: str) -> Tensor:
    """``[sum, count]`` (float64) whose ratio is the batch mean of ``weights`` [B, T]: over tokens, or
    over non-empty sequences for ``sequence`` (one weight per sequence). All-reduce it (sum) over DP."""
    w = weights.detach().to(torch.float64)
    if tis_mode == "sequence":  # the weight is constant along a sequence: its token mean is the weight
        per_seq = masked_mean(w, response_mask, dim=-1)  # [B], 0 for empty rows
        return torch.stack([per_seq.sum(), response_mask.bool().any(-1).sum().to(torch.float64)])
    return torch.stack([masked_sum(w, response_mask), response_mask.bool().sum().to(torch.float64)])


def normalize_is_weights(weights: Tensor, moments: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """``weights`` [B, T] divided by their batch mean ``moments[0] / moments[1]`` (see
    ``is_weight_moments``), so they average to 1 and the loss scale does not drift with the mismatch."""
    mean = moments[0] / moments[1].clamp(min=1)
    safe = torch.where(mean > 1e-8, mean, 1.0)
    return (weights / safe.to(weights.dtype)), {"tis_batch_norm_factor": safe}


@REJECTION_MODES.register("token")
def _reject_token(log_ratio: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    return (log_ratio >= lo) & (log_ratio <= hi)


@REJECTION_MODES.register("seq_sum")
def _reject_seq_sum(log_ratio: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    seq = masked_sum(log_ratio, mask, dim=-1)  # [B]
    return ((seq >= lo) & (seq <= hi)).unsqueeze(-1).expand_as(log_ratio)


@REJECTION_MODES.register("seq_mean")
def _reject_seq_mean(log_ratio: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    seq = masked_mean(log_ratio, mask, dim=-1)  # [B]
    return ((seq >= lo) & (seq <= hi)).unsqueeze(-1).expand_as(log_ratio)


@REJECTION_MODES.register("seq_max")
def _reject_seq_max(log_ratio: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    inside = _reject_token(log_ratio, mask, lo, hi) | ~mask.bool()
    return inside.all(-1, keepdim=True).expand_as(log_ratio)


def rejection_mask(
    *,
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    mode: str,
    low: float,
    high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``response_mask`` [B, T] with rejected tokens set to 0, and metrics; inputs [B, T].

    ``low`` / ``high`` bound the IS ratio (``0 < low <= 1 <= high``); see the module doc for ``mode``.
    Metrics: ``rollout_rs/token_frac`` (response tokens rejected) and ``rollout_rs/seq_frac`` (non-empty
    sequences with any token rejected), both over this batch.
    """
    if not 0 < low <= 1 <= high:
        raise ValueError(
            f"Rejection bounds need 0 < rollout_rs_low <= 1 <= rollout_rs_high, got {low} and {high}."
        )
    log_ratio = _log_ratio(old_log_prob, rollout_log_prob, response_mask)
    keep = REJECTION_MODES.get(mode)(log_ratio, response_mask, math.log(low), math.log(high))
    valid = response_mask.bool()
    rejected = valid & ~keep
    nonempty = valid.any(-1)
    metrics = {
        "rollout_rs/token_frac": masked_mean(rejected.to(torch.float32), response_mask),
        "rollout_rs/seq_frac": (rejected.any(-1) & nonempty).sum() / nonempty.sum().clamp(min=1),
    }
    return torch.where(keep, response_mask, torch.zeros_like(response_mask)), metrics


DIAGNOSTIC_MOMENTS = (
    "sum_w", "sum_w2", "tokens", "sum_seq_w2", "seqs", "sum_train_ppl", "sum_rollout_ppl", "sum_log_ppl_diff",
)  # fmt: skip


def off_policy_moments(*, old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """Float64 sums [8] (names in ``DIAGNOSTIC_MOMENTS``) behind the off-policy diagnostics of the
    batch; inputs [B, T]. Sum them over DP ranks, then call ``off_policy_metrics``."""
    mask = response_mask.bool()
    old, rollout = old_log_prob.detach().to(torch.float64), rollout_log_prob.detach().to(torch.float64)
    log_ratio = torch.clamp(torch.where(mask, old - rollout, 0.0), -SAFETY_BOUND, SAFETY_BOUND)
    w = torch.exp(log_ratio)
    nonempty = mask.any(-1)  # [B]
    seq_lr = torch.clamp(log_ratio.sum(-1), -SAFETY_BOUND, SAFETY_BOUND)  # [B]
    mean_old, mean_rollout = masked_mean(old, mask, dim=-1), masked_mean(rollout, mask, dim=-1)  # [B]

    def seq_sum(x: Tensor) -> Tensor:
        return torch.where(nonempty, x, 0.0).sum()

    return torch.stack(
        [
            masked_sum(w, mask),
            masked_sum(w * w, mask),
            mask.sum().to(torch.float64),
            seq_sum(torch.exp(2 * seq_lr)),
            nonempty.sum().to(torch.float64),
            seq_sum(torch.exp(-mean_old)),
            seq_sum(torch.exp(-mean_rollout)),
            seq_sum(mean_rollout - mean_old),
        ]
    )


def off_policy_metrics(moments: Tensor) -> dict[str, Tensor]:
    """Diagnostics from (global) ``moments`` [8] (see ``off_policy_moments``):

    - ``rollout_corr/ess``: token-level effective sample size fraction ``E[w]^2 / E[w^2]`` (1 = on-policy).
    - ``rollout_corr/chi2_token``: ``E[w^2] - 1``; ``rollout_corr/chi2_seq``: ``E[(prod_t w_t)^2] - 1``.
    - ``rollout_corr/training_ppl`` / ``rollout_corr/rollout_ppl``: mean over sequences of
      ``exp(-mean token log-prob)`` under pi_old / pi_rollout; ``rollout_corr/log_ppl_diff``: mean of
      ``mean log pi_rollout - mean log pi_old`` per sequence (log of the perplexity ratio).
    """
    m = dict(zip(DIAGNOSTIC_MOMENTS, moments.unbind()))
    tokens, seqs = m["tokens"].clamp(min=1), m["seqs"].clamp(min=1)
    mean_w, mean_w2 = m["sum_w"] / tokens, m["sum_w2"] / tokens
    return {
        "rollout_corr/ess": mean_w**2 / mean_w2.clamp(min=1e-30),
        "rollout_corr/chi2_token": mean_w2 - 1,
        "rollout_corr/chi2_seq": m["sum_seq_w2"] / seqs - 1,
        "rollout_corr/training_ppl": m["sum_train_ppl"] / seqs,
        "rollout_corr/rollout_ppl": m["sum_rollout_ppl"] / seqs,
        "rollout_corr/log_ppl_diff": m["sum_log_ppl_diff"] / seqs,
    }


def rollout_gap_metrics(rollout_lp: torch.Tensor, train_lp: torch.Tensor, mask: torch.Tensor) -> dict:
    """rollout / training log-probs [B, R], response mask [B, R] -> mean |gap| over response tokens and the
    fraction of response tokens whose two log-probs differ at all (0 with ``rollout.exact_logprobs``)."""
    return {
        "rollout_logprob_abs_diff": masked_mean((rollout_lp - train_lp).abs(), mask),
        "rollout_logprob_mismatch_frac": masked_mean((rollout_lp != train_lp).to(train_lp.dtype), mask),
    }
