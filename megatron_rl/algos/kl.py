"""KL estimators, KL-in-reward with fixed/adaptive coefficient controllers, and KL as a loss term.

Estimators of KL(pi || pi_ref) per token from ``logprob`` and ``ref_logprob`` (samples drawn from pi),
with ``log r = ref_logprob - logprob`` (Schulman's k1/k2/k3 naming):

- ``k1`` (alias ``kl``): ``-log r``; unbiased value, high variance, can be negative.
- ``k2`` (alias ``mse``): ``0.5 * (log r)**2``.
- ``k3`` (alias ``low_var_kl``): ``r - 1 - log r``; unbiased, low variance, >= 0. ``log r`` is clamped to
  [-20, 20] before ``exp`` and the result to [-10, 10] (as verl), so huge log-ratio gaps cannot overflow.
- ``abs``: ``|log r|``.
- a ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``): the value of that estimator with the gradient of
  ``k2`` (straight-through).

KL as a loss: the gradient of ``k3`` *as a loss* is biased. ``grad k3 = (1 - r) grad logprob``, whose
expectation under pi is ``-E_ref[grad logprob] = grad KL(pi_ref || pi)``: the gradient of the reverse KL,
not of ``KL(pi || pi_ref)`` (``k1`` as a loss is worse: its expected gradient is 0). ``k2`` (or any ``+``
kind) gives the on-policy gradient ``(logprob - ref_logprob) grad logprob``. ``k3`` as a loss is still
common (GRPO); the bias is small while pi stays close to pi_ref.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from megatron_rl.algos.aggregation import Denominator, agg_loss
from megatron_rl.algos.masked import masked_mean
from megatron_rl.algos.registry import Registry

KL_KINDS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("KL kind")


@KL_KINDS.register("k1", "kl")
def _k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return logprob - ref_logprob


@KL_KINDS.register("k2", "mse")
def _k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@KL_KINDS.register("k3", "low_var_kl")
def _k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)


@KL_KINDS.register("abs")
def _abs(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return (logprob - ref_logprob).abs()


def kl_kind_names() -> tuple[str, ...]:
    """Every KL kind, with the straight-through ``+`` variants (the choices of the KL config keys)."""
    return tuple(sorted({*KL_KINDS.names(), *(f"{k}+" for k in KL_KINDS.names())}))


def kl_penalty(*, logprob: Tensor, ref_logprob: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate [B, T] from ``logprob`` and ``ref_logprob`` [B, T]; see the module doc."""
    base = kind.removesuffix("+")
    if base not in KL_KINDS:
        raise ValueError(
            f"Unknown KL kind {kind!r}; choose one of {', '.join(KL_KINDS.names())} (optionally with '+')."
        )
    fn = KL_KINDS.get(base)
    value = fn(logprob, ref_logprob)
    if base == kind or fn is _k2:
        return value
    straight_through = _k2(logprob, ref_logprob)
    return straight_through - straight_through.detach() + value.detach()


class FixedKLController:
    """Constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): moves ``value`` so the observed KL tracks
    ``target_kl``, by at most 20% of ``n_steps / horizon`` per update. Host-side state: ``update`` takes
    a Python float once per step (after the metrics are reduced across DP)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.target, self.horizon = (
            float(state["value"]),
            float(state["target"]),
            int(state["horizon"]),
        )


def apply_kl_in_reward(
    *,
    token_level_scores: Tensor,
    logprob: Tensor,
    ref_logprob: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[Tensor, dict[str, Tensor]]:
    """``token_level_scores - kl_coef * KL`` on response tokens. All tensors [B, T].

    Returns ``(token_level_rewards [B, T], metrics)``; ``metrics["kl_in_reward/kl"]`` is the batch mean
    of per-sequence token-mean KL (reduce it across DP weighted by the number of sequences and feed the
    result to the controller's ``update``).
    """
    kld = torch.where(
        response_mask.bool(), kl_penalty(logprob=logprob, ref_logprob=ref_logprob, kind=kind), 0.0
    )
    rewards = token_level_scores - kl_coef * kld
    seq_kl = masked_mean(kld, response_mask, dim=-1)  # [B]
    metrics = {"kl_in_reward/kl": seq_kl.mean().detach(), "kl_in_reward/coef": torch.tensor(float(kl_coef))}
    return rewards, metrics


def compute_kl_loss(
    *,
    logprob: Tensor,
    ref_logprob: Tensor,
    response_mask: Tensor,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Denominator = None,
    global_num_seqs: Denominator = None,
    seq_len_norm: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL to the reference as a loss term (multiply by the KL-loss coefficient yourself).

    ``logprob`` (with grad), ``ref_logprob``, ``response_mask``: [B, T]. With ``kind="k3"`` (GRPO's
    choice) the gradient is biased; see the module doc. Returns ``(loss, {"kl_loss": loss})``.
    """
    kld = kl_penalty(logprob=logprob, ref_logprob=ref_logprob, kind=kind)
    loss = agg_loss(
        kld,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        seq_len_norm=seq_len_norm,
    )
    return loss, {"kl_loss": masked_mean(kld.detach(), response_mask)}
