"""DAPO's data-side pieces (Yu et al. 2025, arXiv:2503.14476), as pure functions.

- ``informative_groups``: dynamic sampling keeps only prompt groups whose rewards differ (a group whose
  samples all score the same has zero GRPO advantage and only dilutes the batch). A group of one sample
  is kept (it has no spread to test).
- ``overlong_penalty``: soft overlong punishment; responses that reach into the last ``buffer_len``
  tokens before the length cap lose up to ``penalty_factor`` reward, linearly.
- ``overlong_filter``: responses cut at the cap (no EOS) are removed from the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megatron_rl.algos.advantages import group_ids


def informative_groups(scores: Tensor, index: Tensor | Sequence[Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """``keep`` [B] (bool): rows whose group (``index`` [B]) holds at least two distinct ``scores`` [B],
    or only one sample. Pass all rows of every group (gather across DP first). Metrics:
    ``dynamic_sampling/groups`` and ``dynamic_sampling/kept_groups`` (counts)."""
    ids, num_groups = group_ids(index, scores.device)
    lo = torch.full((num_groups,), torch.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(
        0, ids, scores, "amin"
    )
    hi = torch.full_like(lo, -torch.inf).scatter_reduce(0, ids, scores, "amax")
    count = torch.zeros_like(lo).index_add_(0, ids, torch.ones_like(scores))
    kept = (hi > lo) | (count == 1)  # [G]
    metrics = {
        "dynamic_sampling/groups": torch.tensor(float(num_groups)),
        "dynamic_sampling/kept_groups": kept.sum(),
    }
    return kept[ids], metrics


def overlong_penalty(
    response_length: Tensor, *, max_response_length: int, buffer_len: int, penalty_factor: float
) -> Tensor:
    """Penalty [B] (<= 0) for ``response_length`` [B]: 0 up to ``max_response_length - buffer_len`` tokens,
    then falling linearly to ``-penalty_factor`` at ``max_response_length``."""
    if not 0 < buffer_len < max_response_length:
        raise ValueError(
            f"reward.overlong_buffer.len={buffer_len} must be in (0, rollout.max_new_tokens="
            f"{max_response_length}); set it to e.g. {max(1, max_response_length // 4)} or 0 (off)."
        )
    exceed = response_length.to(torch.float64) - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def overlong_filter(response_mask: Tensor, truncated: Tensor) -> Tensor:
    """``response_mask`` [B, T] with the rows of ``truncated`` [B] (bool: cut at the length cap) zeroed."""
    return torch.where(truncated.unsqueeze(-1), torch.zeros_like(response_mask), response_mask)
