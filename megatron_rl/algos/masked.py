"""Masked reductions and whitening over response tokens.

Masks are ``[B, T]`` with 1 on response tokens (bool, int or float). Values outside the mask are never
read (``torch.where``, not multiplication, so ``inf``/``nan`` in padding cannot leak in).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` [B, T] over ``mask`` [B, T]; over everything, or along ``dim``."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` [B, T] over ``mask`` [B, T]; an empty mask gives 0, not nan."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_moments(values: Tensor, mask: Tensor) -> Tensor:
    """``[sum, sum of squares, count]`` of ``values`` [B, T] over ``mask`` [B, T], in float64.

    Float64 because the variance is later formed as ``sumsq - sum**2 / n``; these moments are what a
    data-parallel group all-reduces (sum) to whiten over the global batch.
    """
    v = values.detach().to(torch.float64)
    return torch.stack([masked_sum(v, mask), masked_sum(v * v, mask), mask.bool().sum().to(torch.float64)])


def whiten_from_moments(values: Tensor, mask: Tensor, moments: Tensor, eps: float = 1e-8) -> Tensor:
    """Whiten ``values`` [B, T] with ``moments`` [3] (see ``masked_moments``); zero outside ``mask``.

    ``(x - mean) / sqrt(var + eps)`` with the Bessel-corrected variance, as verl's ``masked_whiten``.
    """
    total, total_sq, count = moments.unbind()
    mean = total / count.clamp(min=1)
    var = ((total_sq - total * mean) / (count - 1).clamp(min=1)).clamp(min=0)
    whitened = (values.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, 0.0).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Whiten ``values`` [B, T] over the tokens of ``mask`` [B, T] of this batch; zero outside it."""
    return whiten_from_moments(values, mask, masked_moments(values, mask), eps)
