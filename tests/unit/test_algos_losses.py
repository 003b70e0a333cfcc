"""Policy, value and entropy losses and loss aggregation against plain float64 loop references."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss,
)

B, T = 8, 6
LOW, HIGH, C = 0.2, 0.28, 3.0
NORM = 10  # seq-mean-token-sum-norm constant


def make_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    old_log_prob = log_prob - 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    old_log_prob[0, :3] = log_prob[0, :3] - torch.tensor([1.5, -2.0, 1.2], dtype=torch.float64)  # ratio > c
    advantages = torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages[0, :3] = torch.tensor([-1.0, -0.5, 0.7], dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[2] = 0  # empty response
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    rollout = old_log_prob + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    return log_prob, old_log_prob, advantages, mask, rollout


def ref_agg(loss, mask, mode):
    """Loop reference of the five modes with local denominators (non-empty sequences counted)."""
    seqs = [[loss[b][t] for t in range(T) if mask[b][t]] for b in range(B)]
    seqs = [s for s in seqs if s]
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    if mode == "token-sum":
        return sum(sum(s) for s in seqs)
    return sum(sum(s) for s in seqs) / (len(seqs) * NORM)


def token_mean(values, mask):
    kept = [values[b][t] for b in range(B) for t in range(T) if mask[b][t]]
    return sum(kept) / len(kept)


def ref_ppo(lp, old, adv, mask, clip_c):
    loss, clipped, lower = (
        [[0.0] * T for _ in range(B)],
        [[0.0] * T for _ in range(B)],
        [[0.0] * T for _ in range(B)],
    )
    for b in range(B):
        for t in range(T):
            ratio = math.exp(min(max(lp[b][t] - old[b][t], -20), 20))
            a = adv[b][t]
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - LOW), 1 + HIGH)
            value, clipped[b][t] = max(l1, l2), float(l2 > l1)
            if clip_c is not None and a < 0:
                lower[b][t] = float(value > -a * clip_c)
                value = min(value, -a * clip_c)
            loss[b][t] = value
    return loss, clipped, lower


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip_c", [C, None])
def test_ppo_loss_matches_loop_reference(mode, clip_c):
    lp, old, adv, mask, _ = make_batch(0)
    loss, metrics = compute_policy_loss(
        "vanilla",
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        seq_len_norm=NORM,
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=clip_c,
    )
    m = mask.tolist()
    token_loss, clipped, lower = ref_ppo(lp.tolist(), old.tolist(), adv.tolist(), m, clip_c)
    assert math.isclose(loss.item(), ref_agg(token_loss, m, mode), abs_tol=1e-12)
    assert math.isclose(metrics["pg_clipfrac"].item(), token_mean(clipped, m), abs_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac_lower"].item(), token_mean(lower, m), abs_tol=1e-6)
    assert math.isclose(metrics["ppo_kl"].item(), token_mean((old - lp).tolist(), m), abs_tol=1e-12)
    if clip_c is not None:
        assert metrics["pg_clipfrac_lower"] > 0 and metrics["pg_clipfrac"] > 0  # both clips are exercised


def test_ppo_gradient_matches_loop_reference():
    lp, old, adv, mask, _ = make_batch(1)
    leaf = lp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(
        "ppo",
        old_log_prob=old,
        log_prob=leaf,
        advantages=adv,
        response_mask=mask,
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=C,
    )
    loss.backward()
    n = mask.sum().item()
    want = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            ratio, a = math.exp(lp[b, t].item() - old[b, t].item()), adv[b, t].item()
            unclipped_active = -a * ratio >= -a * min(max(ratio, 1 - LOW), 1 + HIGH)
            capped = a < 0 and -a * ratio > -a * C
            if mask[b, t] and unclipped_active and not capped:
                want[b, t] = -a * ratio / n
    torch.testing.assert_close(leaf.grad, want, rtol=1e-10, atol=1e-12)


def test_gspo_matches_loop_reference():
    lp, old, adv, mask, _ = make_batch(2)
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        "gspo",
        old_log_prob=old,
        log_prob=leaf,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
    )
    loss.backward()
    token_loss, grad, clipped = [[0.0] * T for _ in range(B)], torch.zeros(B, T, dtype=torch.float64), []
    n_seqs = sum(1 for b in range(B) if mask[b].any())
    for b in range(B):
        n = int(mask[b].sum().item())
        if n == 0:
            continue
        ratio = math.exp(min(sum(lp[b, t].item() - old[b, t].item() for t in range(n)) / n, 10.0))
        for t in range(n):
            a = adv[b, t].item()
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - LOW), 1 + HIGH)
            token_loss[b][t] = max(l1, l2)
            clipped.append(float(l2 > l1))
            grad[b, t] = -a * ratio / n / n_seqs if l1 >= l2 else 0.0
    assert math.isclose(loss.item(), ref_agg(token_loss, mask.tolist(), "seq-mean-token-mean"), abs_tol=1e-12)
    assert math.isclose(metrics["pg_clipfrac"].item(), sum(clipped) / len(clipped), abs_tol=1e-6)
    torch.testing.assert_close(leaf.grad, grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tis_mode", ["token", "sequence"])
def test_truncated_importance_sampling_matches_loop_reference(tis_mode):
    lp, old, adv, mask, rollout = make_batch(3)
    cap = 1.1
    loss, metrics = compute_policy_loss(
        "vanilla",
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        rollout_log_prob=rollout,
        tis_mode=tis_mode,
        tis_cap=cap,
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=C,
    )
    m = mask.tolist()
    token_loss, _, _ = ref_ppo(lp.tolist(), old.tolist(), adv.tolist(), m, C)
    weights, capped = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for b in range(B):
        seq_log_w = sum(old[b, t].item() - rollout[b, t].item() for t in range(T) if m[b][t])
        for t in range(T):
            log_w = old[b, t].item() - rollout[b, t].item() if tis_mode == "token" else seq_log_w
            weights[b][t], capped[b][t] = min(math.exp(log_w), cap), float(log_w > math.log(cap))
            token_loss[b][t] *= weights[b][t]
    assert math.isclose(loss.item(), ref_agg(token_loss, m, "token-mean"), abs_tol=1e-12)
    assert math.isclose(metrics["tis_weight_mean"].item(), token_mean(weights, m), abs_tol=1e-12)
    assert math.isclose(metrics["tis_clipfrac"].item(), token_mean(capped, m), abs_tol=1e-6)
    assert 0 < metrics["tis_clipfrac"] < 1


def test_tis_without_rollout_log_prob_raises():
    lp, old, adv, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_policy_loss(
            "vanilla", old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, tis_mode="token"
        )
    with pytest.raises(ValueError, match="gspo"):
        get_policy_loss("trpo")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cliprange", [0.2, None])
def test_value_loss_matches_loop_reference(mode, cliprange):
    gen = torch.Generator().manual_seed(4)
    vpreds, values, returns = (torch.randn(B, T, generator=gen, dtype=torch.float64) for _ in range(3))
    _, _, _, mask, _ = make_batch(4)
    loss, metrics = compute_value_loss(
        vpreds=vpreds,
        values=values,
        returns=returns,
        response_mask=mask,
        cliprange_value=cliprange,
        loss_agg_mode=mode,
        seq_len_norm=NORM,
    )
    token_loss, clipped = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            v, old, ret = vpreds[b, t].item(), values[b, t].item(), returns[b, t].item()
            vc = v if cliprange is None else min(max(v, old - cliprange), old + cliprange)
            token_loss[b][t] = 0.5 * max((v - ret) ** 2, (vc - ret) ** 2)
            clipped[b][t] = float((vc - ret) ** 2 > (v - ret) ** 2)
    m = mask.tolist()
    assert math.isclose(loss.item(), ref_agg(token_loss, m, mode), abs_tol=1e-12)
    assert math.isclose(metrics["vf_clipfrac"].item(), token_mean(clipped, m), abs_tol=1e-6)
    assert (metrics["vf_clipfrac"] > 0) == (cliprange is not None)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_entropy_loss_and_agg_match_loop_reference(mode):
    entropy = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    _, _, _, mask, _ = make_batch(5)
    loss, metrics = compute_entropy_loss(
        entropy=entropy, response_mask=mask, loss_agg_mode=mode, seq_len_norm=NORM
    )
    assert math.isclose(loss.item(), ref_agg(entropy.tolist(), mask.tolist(), mode), abs_tol=1e-12)
    assert math.isclose(metrics["entropy"].item(), token_mean(entropy.tolist(), mask.tolist()), abs_tol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_losses_sum_to_global_loss(mode):
    loss_mat = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    _, _, _, mask, _ = make_batch(6)
    full = agg_loss(loss_mat, mask, mode, seq_len_norm=NORM)
    tokens, seqs = mask.sum(), mask.bool().any(-1).sum()
    parts = [
        agg_loss(
            loss_mat[i : i + 3],
            mask[i : i + 3],
            mode,
            global_num_tokens=tokens,
            global_num_seqs=seqs,
            seq_len_norm=NORM,
        )
        for i in range(0, B, 3)
    ]
    torch.testing.assert_close(sum(parts), full, rtol=0, atol=1e-12)


def test_agg_loss_unknown_mode_raises():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "seq-sum")
