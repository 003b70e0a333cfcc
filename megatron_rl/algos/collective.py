"""The collective layer around the pure algorithms: process groups come in as arguments.

- ``compute_advantages_dp``: group statistics when a prompt's samples sit on different DP ranks
  (all-gather scores and group ids, then the pure estimator) and whitening over the global batch
  (all-reduce of sum / sum of squares / count).
- ``global_loss_denominators``: response tokens and non-empty sequences of a whole optimizer step
  (every micro-batch on every DP rank), the denominators ``aggregation.agg_loss`` wants.
- ``all_reduce_metrics``: weighted means, sums, maxima and minima of scalar metrics across DP.
- ``informative_groups_dp``: DAPO's group filter when a group's samples sit on different DP ranks.
- ``all_reduce_sum``: a sum over the group (the moments behind global means, e.g. IS normalisation).

A ``group`` of None means a single process (no collective runs), not the default world group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.algos.advantages import get_advantage_estimator, get_estimator_traits
from megatron_rl.algos.dapo import informative_groups
from megatron_rl.algos.masked import masked_moments, whiten_from_moments


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(tensor: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    if _size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _all_gather_rows(rows: Tensor, group) -> tuple[Tensor, int]:
    """Concatenate ``rows`` [b, ...] of every rank (b may differ) in rank order; also return this
    rank's offset in the result."""
    if _size(group) == 1:
        return rows, 0
    sizes = [torch.zeros(1, dtype=torch.long, device=rows.device) for _ in range(_size(group))]
    dist.all_gather(sizes, torch.tensor([rows.shape[0]], device=rows.device), group=group)
    sizes = [int(s) for s in sizes]  # host-side shapes: one sync per call
    padded = torch.zeros((max(sizes), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    rank = dist.get_rank(group)
    return torch.cat([g[:n] for g, n in zip(gathered, sizes)]), sum(sizes[:rank])


def _all_gather_index(index: Tensor | Sequence[Any], group) -> Tensor | list[Any]:
    if isinstance(index, Tensor):
        return _all_gather_rows(index, group)[0]
    if _size(group) == 1:
        return list(index)
    gathered: list[Any] = [None] * _size(group)
    dist.all_gather_object(gathered, list(index), group=group)
    return [key for keys in gathered for key in keys]


def global_masked_whiten(values: Tensor, mask: Tensor, group, eps: float = 1e-8) -> Tensor:
    """Whiten ``values`` [B, T] over the response tokens (``mask`` [B, T]) of all ranks of ``group``."""
    return whiten_from_moments(values, mask, _all_reduce(masked_moments(values, mask), group), eps)


def _grouped_outcome(
    name: str, token_level_rewards: Tensor, response_mask: Tensor, index, dp_group, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """Run a grouped estimator on the scores of the whole DP group; keep this rank's rows.

    Grouped estimators see rewards only through row sums (scores) and the response lengths (assistant
    tokens, passed as ``response_length``), so ``[B_global, 1]`` rewards with a mask of ones reproduce
    them exactly; this rank's mask is applied afterwards.
    """
    if index is None:
        raise ValueError(f"Advantage estimator {name!r} groups samples by prompt: pass index=[B] group ids.")
    local = torch.stack(
        [token_level_rewards.sum(-1), response_mask.to(token_level_rewards.dtype).sum(-1)], -1
    )
    gathered, offset = _all_gather_rows(local, dp_group)  # [B_global, 2]: score, length
    scores, lengths = gathered.unbind(-1)
    all_index = _all_gather_index(index, dp_group)
    ones = torch.ones_like(scores).unsqueeze(-1)  # [B_global, 1]
    adv, _ = get_advantage_estimator(name)(
        token_level_rewards=scores.unsqueeze(-1),
        response_mask=ones,
        index=all_index,
        response_length=lengths,
        **kwargs,
    )  # [B_global, 1]
    local = adv[offset : offset + token_level_rewards.shape[0]]  # [B, 1]
    return (local * response_mask.to(local.dtype),) * 2


def compute_advantages_dp(
    name: str,
    *,
    dp_group,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor | Sequence[Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns [B, T] for this rank's rows, identical to running the pure estimator
    ``name`` on the concatenation of all DP ranks' batches.

    ``token_level_rewards``, ``response_mask``: [B, T] (B and T may differ per rank); ``index``: [B]
    group ids (grouped estimators); other keyword arguments (``values``, ``gamma``, ``lam``,
    ``epsilon``, ``norm_adv_by_std``) go to the estimator.
    """
    traits = get_estimator_traits(name)
    if traits.whitened:
        kwargs["whiten"] = False
    if traits.grouped:
        advantages, returns = _grouped_outcome(
            name, token_level_rewards, response_mask, index, dp_group, **kwargs
        )
    else:
        advantages, returns = get_advantage_estimator(name)(
            token_level_rewards=token_level_rewards, response_mask=response_mask, index=index, **kwargs
        )
    if not traits.whitened:
        return advantages, returns
    advantages = global_masked_whiten(advantages, response_mask, dp_group)
    # Grouped estimators return their advantages as returns (no critic); the others keep raw returns.
    return advantages, (advantages if traits.grouped else returns)


def all_reduce_sum(tensor: Tensor, group) -> Tensor:
    """``tensor`` summed over the ranks of ``group`` (in place; returned)."""
    return _all_reduce(tensor, group)


def all_reduce_max(tensor: Tensor, group) -> Tensor:
    """``tensor``'s element-wise maximum over the ranks of ``group`` (in place; returned)."""
    return _all_reduce(tensor, group, dist.ReduceOp.MAX)


def informative_groups_dp(scores: Tensor, index: Tensor | Sequence[Any], dp_group) -> tuple[Tensor, dict]:
    """``informative_groups`` on the scores [B] and group ids [B] of every rank of ``dp_group``; returns
    this rank's ``keep`` [B] and the global metrics."""
    all_scores, offset = _all_gather_rows(scores, dp_group)  # [B_global]
    keep, metrics = informative_groups(all_scores, _all_gather_index(index, dp_group))
    return keep[offset : offset + scores.shape[0]], metrics


def global_loss_denominators(response_masks: Sequence[Tensor], dp_group) -> tuple[Tensor, Tensor]:
    """``(num_tokens, num_seqs)``: response tokens and non-empty sequences over all micro-batch masks
    ``response_masks`` (each [b, T]) of this rank's share of an optimizer step, summed over ``dp_group``.
    """
    device = response_masks[0].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for mask in response_masks:
        counts += torch.stack([mask.bool().sum(), mask.bool().any(-1).sum()]).to(torch.float64)
    num_tokens, num_seqs = _all_reduce(counts, dp_group).unbind()
    return num_tokens, num_seqs


_OPS = ("mean", "sum", "max", "min")


def _stack(values: list[Tensor], device) -> Tensor:
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([v.detach().to(device=device, dtype=torch.float64).reshape(()) for v in values])


def all_reduce_metrics(
    metrics: dict[str, Tensor],
    group,
    *,
    weight: Tensor | float = 1.0,
    reduce_ops: dict[str, str] | None = None,
) -> dict[str, Tensor]:
    """Reduce scalar ``metrics`` across ``group`` (float64 results): ``mean`` (default; weighted by
    ``weight``, e.g. the local token count, so the result is the global mean), ``sum``, ``max`` or
    ``min`` per ``reduce_ops[name]``. Two all-reduces whatever the number of metrics."""
    reduce_ops = reduce_ops or {}
    unknown = {op for op in reduce_ops.values() if op not in _OPS}
    if unknown:
        raise ValueError(f"Unknown metric reductions {sorted(unknown)}; use one of {', '.join(_OPS)}.")
    names = {op: [k for k in metrics if reduce_ops.get(k, "mean") == op] for op in _OPS}
    device = next(iter(metrics.values())).device if metrics else torch.device("cpu")
    w = torch.as_tensor(weight, dtype=torch.float64, device=device).reshape(1)
    means, sums = (_stack([metrics[k] for k in names[op]], device) for op in ("mean", "sum"))
    totals = _all_reduce(torch.cat([means * w, sums, w]), group)
    extremes = torch.cat(
        [
            _stack([metrics[k] for k in names["max"]], device),
            -_stack([metrics[k] for k in names["min"]], device),
        ]
    )
    if extremes.numel():
        extremes = _all_reduce(extremes, group, dist.ReduceOp.MAX)
    n_mean, n_max = len(names["mean"]), len(names["max"])
    out = {k: totals[i] / totals[-1] for i, k in enumerate(names["mean"])}
    out.update({k: totals[n_mean + i] for i, k in enumerate(names["sum"])})
    out.update({k: extremes[i] for i, k in enumerate(names["max"])})
    out.update({k: -extremes[n_max + i] for i, k in enumerate(names["min"])})
    return out
