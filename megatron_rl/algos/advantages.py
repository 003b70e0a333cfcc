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
from megatron_rl.algos.registry import Registry

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class EstimatorTraits:
    """What the collective layer must do around an estimator."""

    grouped: bool  # outcome-level: uses rewards only via row sums, and needs whole groups (``index``)
    whitened: bool  # whitens over the batch's response tokens (accepts ``whiten=False``)
    greedy_baseline: bool = False  # needs ``reward_baselines``: the score of a greedy sample per prompt


_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
_TRAITS: dict[str, EstimatorTraits] = {}


def register_advantage_estimator(
    name: str, *, grouped: bool = False, whitened: bool = False, greedy_baseline: bool = False
):
    """Decorator adding an estimator to the registry under ``name`` (a name taken twice is an error)."""

    def wrap(fn: AdvantageEstimator) -> AdvantageEstimator:
        _ESTIMATORS.add(name, fn)
        _TRAITS[name] = EstimatorTraits(grouped=grouped, whitened=whitened, greedy_baseline=greedy_baseline)
        return fn

    return wrap


def advantage_estimator_names() -> tuple[str, ...]:
    """Every registered estimator name (the choices of ``algorithm.adv_estimator``)."""
    return _ESTIMATORS.names()


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name`` (``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``, ...)."""
    return _ESTIMATORS.get(name)


def get_estimator_traits(name: str) -> EstimatorTraits:
    """Whether estimator ``name`` is grouped and/or whitened."""
    _ESTIMATORS.get(name)
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

    Masked positions (padding, and tool/user tokens inside a multi-turn response) are not time steps:
    the TD error of an assistant token bootstraps from the value of the next assistant token after the
    gap, and the advantage flows across the gap to earlier turns (verl >= 0.9.1 multi-turn GAE). Values
    at masked positions are never read; a reward at a masked position (e.g. a tool's reward) is credited
    to the assistant token before it, undiscounted, so no reward is lost. Returns ``(advantages,
    returns)`` [B, T]: returns = raw advantages + values (not whitened); advantages whitened over the
    batch's response tokens unless ``whiten=False``.
    """
    keep = response_mask.bool()
    zero = torch.zeros_like(values[:, 0])  # [B]
    next_value, last_gae, gap_reward = zero, zero, zero
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        reward = token_level_rewards[:, t] + gap_reward
        delta = reward + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        last_gae = torch.where(keep[:, t], gae_t, last_gae)
        gap_reward = torch.where(keep[:, t], zero, reward)
        reversed_adv.append(torch.where(keep[:, t], last_gae, zero))
    advantages = torch.stack(reversed_adv[::-1], dim=1)  # [B, T]
    returns = torch.where(keep, advantages + values, 0.0)
    advantages = masked_whiten(advantages, response_mask) if whiten else advantages
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
    Masked positions are not time steps: the running return is carried across tool/user tokens inside
    a response unchanged (undiscounted), so a final reward reaches every earlier turn, and a reward at a
    masked position is credited to the assistant token before it, undiscounted (as GAE above).
    """
    keep = response_mask.bool()
    zero = torch.zeros_like(token_level_rewards[:, 0])  # [B]
    running, gap_reward = zero, zero
    reversed_ret = []
    for t in reversed(range(token_level_rewards.shape[1])):
        reward = token_level_rewards[:, t] + gap_reward
        running = torch.where(keep[:, t], reward + gamma * running, running)
        gap_reward = torch.where(keep[:, t], zero, reward)
        reversed_ret.append(torch.where(keep[:, t], running, zero))
    returns = torch.stack(reversed_ret[::-1], dim=1)  # [B, T]
    advantages = masked_whiten(returns, response_mask) if whiten else returns
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


@register_advantage_estimator("opo", grouped=True)
def compute_opo_outcome_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor | Sequence[Any],
    response_length: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025, arXiv:2505.23585): score minus the length-weighted mean score of its group,
    ``sum_j len_j * score_j / sum_j len_j`` (the optimal baseline for sequence-level rewards); a group of
    one keeps its raw score. ``token_level_rewards``, ``response_mask``: [B, T]; ``index``: [B];
    ``response_length``: [B] assistant-token counts (default: the row sums of ``response_mask``)."""
    scores = token_level_rewards.sum(-1)  # [B]
    lengths = response_mask.to(scores.dtype).sum(-1) if response_length is None else response_length
    lengths = lengths.to(scores.dtype)
    ids, num_groups = group_ids(index, scores.device)
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, ids, torch.ones_like(scores)
    )
    weighted = torch.zeros_like(count).index_add_(0, ids, lengths * scores)
    total_len = torch.zeros_like(count).index_add_(0, ids, lengths)
    baseline = torch.where(count > 1, weighted / total_len.clamp(min=1), 0.0)  # [G]
    return _outcome(scores - baseline[ids], response_mask)


@register_advantage_estimator("gpg", grouped=True)
def compute_gpg_outcome_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor | Sequence[Any],
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025, arXiv:2504.02546): ``alpha * (score - group mean)`` with
    ``alpha = B / (number of samples with a non-zero score)``, which rescales the gradient for the
    samples that carry no signal. ``token_level_rewards``, ``response_mask``: [B, T]; ``index``: [B].
    Pair it with ``actor.policy_loss=gpg`` (plain policy gradient, no ratio)."""
    scores = token_level_rewards.sum(-1)  # [B]
    ids, num_groups = group_ids(index, scores.device)
    _, mean, _ = group_mean_std(scores, ids, num_groups)
    alpha = scores.numel() / (scores != 0).sum().clamp(min=1).to(scores.dtype)
    return _outcome(alpha * (scores - mean[ids]), response_mask)


@register_advantage_estimator("grpo_passk", grouped=True)
def compute_grpo_passk_outcome_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor | Sequence[Any],
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO for pass@k (arXiv:2503.19595): only the best sample of each group (the first one on ties)
    gets an advantage, ``best - second best`` (divided by ``group std + epsilon`` unless
    ``norm_adv_by_std=False``); the others get 0. Every group needs >= 2 samples.
    ``token_level_rewards``, ``response_mask``: [B, T]; ``index``: [B]."""
    scores = token_level_rewards.sum(-1)  # [B]
    ids, num_groups = group_ids(index, scores.device)
    count, _, std = group_mean_std(scores, ids, num_groups)
    if bool((count < 2).any()):
        raise ValueError("adv_estimator=grpo_passk needs at least 2 samples per prompt; set rollout.n >= 2.")
    by_score = torch.argsort(scores, descending=True, stable=True)  # [B]
    order = by_score[torch.argsort(ids[by_score], stable=True)]  # grouped, best first within a group
    starts = torch.cumsum(count.long(), 0) - count.long()  # [G] first row of each group in ``order``
    best, second = order[starts], order[starts + 1]  # [G]
    gap = scores[best] - scores[second]
    gap = gap / (std + epsilon) if norm_adv_by_std else gap
    per_sample = torch.zeros_like(scores).index_put_((best,), gap)  # [B]
    return _outcome(per_sample, response_mask)


@register_advantage_estimator("remax", greedy_baseline=True)
def compute_remax_outcome_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor, **_: Any
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): return-to-go minus the score of a greedy rollout of the
    same prompt. ``token_level_rewards``, ``response_mask``: [B, T]; ``reward_baselines``: [B] (the
    trainer generates and scores one greedy sample per prompt). Rewards at masked positions count in
    the return of the tokens before them. Returns ``(advantages, returns)`` [B, T]."""
    to_go = token_level_rewards.flip(-1).cumsum(-1).flip(-1)  # [B, T]
    keep = response_mask.bool()
    returns = torch.where(keep, to_go, 0.0)
    advantages = torch.where(keep, to_go - reward_baselines.to(to_go.dtype).unsqueeze(-1), 0.0)
    return advantages, returns
