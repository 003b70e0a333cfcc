"""KL estimators, controllers, KL-in-reward and KL loss against plain float64 loop references."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    compute_kl_loss,
    kl_penalty,
)

B, T = 6, 5


def make_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logprob = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    ref = logprob + torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref[0, 0], ref[0, 1] = logprob[0, 0] + 30.0, logprob[0, 1] - 30.0  # exercise the clamps
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[1] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    return logprob, ref, mask


def ref_kl(lp: float, ref: float, kind: str) -> float:
    if kind in ("k1", "kl"):
        return lp - ref
    if kind in ("k2", "mse"):
        return 0.5 * (lp - ref) ** 2
    if kind == "abs":
        return abs(lp - ref)
    log_r = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(log_r) - log_r - 1, -10.0), 10.0)


@pytest.mark.parametrize("kind", ["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"])
def test_kl_kinds_match_loop_reference(kind):
    logprob, ref, _ = make_batch(0)
    got = kl_penalty(logprob=logprob, ref_logprob=ref, kind=kind)
    want = [[ref_kl(logprob[b, t].item(), ref[b, t].item(), kind) for t in range(T)] for b in range(B)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    if kind in ("k3", "low_var_kl"):
        assert got[0, 0] == 10.0 and got[0, 1] == 10.0  # clamped, finite


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+"])
def test_straight_through_kinds_have_k2_gradient(kind):
    logprob, ref, _ = make_batch(1)
    lp = logprob.clone().requires_grad_(True)
    value = kl_penalty(logprob=lp, ref_logprob=ref, kind=kind)
    torch.testing.assert_close(value, kl_penalty(logprob=logprob, ref_logprob=ref, kind=kind[:-1]))
    value.sum().backward()
    torch.testing.assert_close(lp.grad, logprob - ref)  # d/dlp of 0.5 (lp - ref)^2


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(logprob=torch.zeros(1, 1), ref_logprob=torch.zeros(1, 1), kind="k4")


def test_controllers_update_and_round_trip():
    fixed = FixedKLController(0.1)
    fixed.update(current_kl=5.0, n_steps=8)
    assert fixed.value == 0.1
    adaptive = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.05, horizon=100)
    adaptive.update(current_kl=0.06, n_steps=10)  # error 0.2 -> clipped at 0.2
    assert math.isclose(adaptive.value, 0.2 * (1 + 0.2 * 10 / 100))
    adaptive.update(current_kl=0.045, n_steps=10)  # error -0.1
    assert math.isclose(adaptive.value, 0.2 * (1 + 0.2 * 0.1) * (1 - 0.1 * 0.1))
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=1.0, horizon=1)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.state_dict() == adaptive.state_dict()
    restored_fixed = FixedKLController(0.0)
    restored_fixed.load_state_dict(fixed.state_dict())
    assert restored_fixed.value == 0.1


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_in_reward_matches_loop_reference(kind):
    logprob, ref, mask = make_batch(2)
    scores = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    rewards, metrics = apply_kl_in_reward(
        token_level_scores=scores,
        logprob=logprob,
        ref_logprob=ref,
        response_mask=mask,
        kl_coef=0.3,
        kind=kind,
    )
    want, seq_kls = [], []
    for b in range(B):
        kls = [ref_kl(logprob[b, t].item(), ref[b, t].item(), kind) if mask[b, t] else 0.0 for t in range(T)]
        want.append([scores[b, t].item() - 0.3 * kls[t] for t in range(T)])
        n = int(mask[b].sum().item())
        seq_kls.append(sum(kls) / n if n else 0.0)
    torch.testing.assert_close(rewards, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert math.isclose(metrics["kl_in_reward/kl"].item(), sum(seq_kls) / B, abs_tol=1e-12)


def test_kl_loss_token_mean_matches_loop_reference():
    logprob, ref, mask = make_batch(3)
    lp = logprob.clone().requires_grad_(True)
    loss, metrics = compute_kl_loss(logprob=lp, ref_logprob=ref, response_mask=mask, kind="k3")
    kls = [
        ref_kl(logprob[b, t].item(), ref[b, t].item(), "k3") for b in range(B) for t in range(T) if mask[b, t]
    ]
    assert math.isclose(loss.item(), sum(kls) / len(kls), abs_tol=1e-12)
    assert math.isclose(metrics["kl_loss"].item(), loss.item(), abs_tol=1e-12)
    loss.backward()
    # k3's gradient (1 - r) per token, clamps aside: the biased estimator documented in kl.py.
    ratio = torch.exp((ref - logprob).clamp(-20, 20))
    inside = (ratio - (ref - logprob) - 1).abs() < 10
    want = torch.where(mask.bool() & inside, (1 - ratio) / len(kls), 0.0)
    torch.testing.assert_close(lp.grad, want, rtol=1e-10, atol=1e-12)
