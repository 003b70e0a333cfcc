"""Advantage estimators: pure functions behind a name registry.

Every estimator takes keyword arguments ``token_level_rewards`` [B, T], ``response_mask`` [B, T] and
whatever else it needs (``index`` [B] group ids, ``values`` [B, T], ``gamma``, ``lam``, ``epsilon``,
``norm_adv_by_std``), ignores the rest, and returns ``(advantages [B, T], returns [B, T])``, both zero
outside the response mask. Rewards are usually zero except at the last response token; a sample's
*score* is the row sum of its token rewards.

Estimators that whiten (``gae``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``) whiten over
the response tokens of the batch they are given; pass ``whiten=False`` to get the raw values and whiten
over the global batch yourself (``collective.compute_advantages_dp`` does this across DP ranks).
Grouped estimators (``grpo``, ``rloo``, ``reinforce_plus_plus_baseline``) need every sample of a group
in the same call; ``collective.compute_advantages_dp`` gathers scores across DP ranks first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_rl.algos.masked import masked_whiten

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class EstimatorTraits:
    """What the collective layer must do around an estimator."""

    grouped: bool  # outcome-level: uses rewards only via row sums, and needs whole groups (``index``)
    whitened: bool  # whitens over the batch's response tokens (accepts ``whiten=False``)


_ESTIMATORS: dict[str, AdvantageEstimator] = {}
_TRAITS: dict[str, EstimatorTraits] = {}


def register_advantage_estimator(name: str, *, grouped: bool = False, whitened: bool = False):
    """Decorator adding an estimator to the registry under ``name``."""

    def wrap(fn: AdvantageEstimator) -> AdvantageEstimator:
        _ESTIMATORS[name] = fn
        _TRAITS[name] = EstimatorTraits(grouped=grouped, whitened=whitened)
        return fn

    return wrap


def _check_name(name: str) -> None:
    if name not in _ESTIMATORS:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; choose one of {', '.join(sorted(_ESTIMATORS))}."
        )


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name`` (``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``, ...)."""
    _check_name(name)
    return _ESTIMATORS[name]


def get_estimator_traits(name: str) -> EstimatorTraits:
    """Whether estimator ``name`` is grouped and/or whitened."""
    _check_name(name)
    return _TRAITS[name]


def group_ids(index: Tensor | Sequence[Any], device: torch.device | None = None) -> tuple[Tensor, int]:
    """``(ids [B], G)``: dense group ids in ``[0, G)`` from ``index`` [B] (an int tensor, a list or a
    numpy array of hashables); equal entries get equal ids."""
    if isinstance(index, Tensor):
        uniques, ids = torch.unique(index, return_inverse=True)
        return ids.to(device), uniques.numel()
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(key, len(dense)) for key in list(index)]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)


def group_mean_std(scores: Tensor, ids: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group ``(count [G], mean [G], std [G])`` of ``scores`` [B] grouped by dense ``ids`` [B].

    The std is Bessel-corrected. A group of one gets mean 0 and std 1 (verl's convention: its raw
    score passes through GRPO unchanged).
    """
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, ids, torch.ones_like(scores)
    )
    total = torch.zeros_like(count).index_add_(0, ids, scores)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, ids, (scores - mean[ids]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    single = count == 1
    return count, torch.where(single, 0.0, mean), torch.where(single, 1.0, std)


def _outcome(scores: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Broadcast per-sample ``scores`` [B] over the response tokens of ``response_mask`` [B, T]."""
    adv = scores.unsqueeze(-1) * response_mask.to(scores.dtype)  # [B, T]
    return adv, adv


@register_advantage_estimator("gae", whitened=True)
def compute_gae_advantage_return(
    *,
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GAE over response tokens. ``token_level_rewards``, ``values``, ``response_mask``: [B, T].

    Non-response positions are skipped (value and TD error carried over them, as verl does). Returns
    ``(advantages, returns)`` [B, T]: returns = raw advantages + values (not whitened); advantages
    whitened over the batch's response tokens unless ``whiten=False``.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])  # [B]
    last_gae = torch.zeros_like(values[:, 0])  # [B]
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)  # [B, T]
    returns = (advantages + values) * mask
    advantages = masked_whiten(advantages, mask) if whiten else advantages * mask
    return advantages, returns


@register_advantage_estimator("grpo", grouped=True)
def compute_grpo_outcome_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor | Sequence[Any],
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO: ``(score - group mean) / (group std + epsilon)``; Dr.GRPO with ``norm_adv_by_std=False``.

    ``token_level_rewards``, ``response_mask``: [B, T]; ``index``: [B] group ids.
    """
    scores = token_level_rewards.sum(-1)  # [B]
    ids, num_groups = group_ids(index, scores.device)
    _, mean, std = group_mean_std(scores, ids, num_groups)
    centred = scores - mean[ids]
    return _outcome(centred / (std[ids] + epsilon) if norm_adv_by_std else centred, response_mask)


@register_advantage_estimator("rloo", grouped=True)
def compute_rloo_outcome_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: Tensor | Sequence[Any], **_: Any
) -> tuple[Tensor, Tensor]:
    """RLOO: score minus the mean score of the *other* samples of its group; a group of one keeps its
    raw score. ``token_level_rewards``, ``response_mask``: [B, T]; ``index``: [B] group ids."""
    scores = token_level_rewards.sum(-1)  # [B]
    ids, num_groups = group_ids(index, scores.device)
    count, mean, _ = group_mean_std(scores, ids, num_groups)
    n = count[ids]
    others_mean = (mean[ids] * n - scores) / (n - 1).clamp(min=1)
    return _outcome(torch.where(n > 1, scores - others_mean, scores), response_mask)


@register_advantage_estimator("reinforce_plus_plus", whitened=True)
def compute_reinforce_plus_plus_outcome_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0, whiten: bool = True, **_: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the batch's response tokens.

    ``token_level_rewards``, ``response_mask``: [B, T]. Returns ``(advantages, returns)`` [B, T].
    The running return is reset at non-response positions.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    running = torch.zeros_like(token_level_rewards[:, 0])  # [B]
    reversed_ret = []
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        reversed_ret.append(running)
        running = running * mask[:, t]
    returns = torch.stack(reversed_ret[::-1], dim=1) * mask  # [B, T]
    advantages = masked_whiten(returns, mask) if whiten else returns
    return advantages, returns


@register_advantage_estimator("reinforce_plus_plus_baseline", grouped=True, whitened=True)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor | Sequence[Any],
    whiten: bool = True,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline: ``score - group mean`` on every response token, then
    whitened over the batch's response tokens. A group of one keeps its raw score before whitening.
    ``token_level_rewards``, ``response_mask``: [B, T]; ``index``: [B] group ids."""
    scores = token_level_rewards.sum(-1)  # [B]
    ids, num_groups = group_ids(index, scores.device)
    _, mean, _ = group_mean_std(scores, ids, num_groups)
    advantages, _ = _outcome(scores - mean[ids], response_mask)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, advantages
