"""Rollout/training mismatch corrections against float64 loop references: IcePop, batch-normalised IS
weights, rejection sampling (token / seq_sum / seq_mean / seq_max) and the off-policy diagnostics, on
masks with interior gaps; moments summed over a split batch equal the whole batch's (DP exactness)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_rl.algos import (
    compute_policy_loss,
    is_weight_moments,
    normalize_is_weights,
    off_policy_metrics,
    off_policy_moments,
    rejection_mask,
    truncated_is_weights,
)

B, T = 9, 6
LOW, HIGH = 0.8, 1.25


def make_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    rollout = old + 0.25 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[[0, 1]], lengths[4] = T, 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    mask[lengths >= 4, 1] = 0.0  # a tool token inside the response
    rollout[0], rollout[1] = old[0] + 0.01, old[1] - 0.005  # two rows inside every bound
    return old, rollout, mask


def rows(mask):
    return [[t for t in range(T) if mask[b][t]] for b in range(B)]


def test_icepop_keeps_the_ratio_inside_the_band_and_zeroes_the_rest():
    old, rollout, mask = make_batch()
    weights, metrics = truncated_is_weights(
        old_log_prob=old,
        rollout_log_prob=rollout,
        response_mask=mask,
        tis_mode="icepop",
        tis_cap=HIGH,
        tis_low=LOW,
    )
    o, r, m = old.tolist(), rollout.tolist(), mask.tolist()
    want, outside = torch.zeros(B, T, dtype=torch.float64), []
    for b, ts in enumerate(rows(m)):
        for t in ts:
            w = math.exp(o[b][t] - r[b][t])
            want[b, t] = w if LOW <= w <= HIGH else 0.0
            outside.append(not LOW <= w <= HIGH)
    keep = mask.bool()
    torch.testing.assert_close(weights[keep], want[keep], rtol=1e-12, atol=0)
    assert math.isclose(metrics["tis_clipfrac"].item(), sum(outside) / len(outside), abs_tol=1e-6)
    assert 0 < sum(outside) < len(outside)


def test_icepop_in_the_policy_loss_zeroes_the_gradient_outside_the_band():
    old, rollout, mask = make_batch()
    lp = old.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(
        "vanilla",
        old_log_prob=old,
        log_prob=lp,
        advantages=torch.ones(B, T, dtype=torch.float64),
        response_mask=mask,
        rollout_log_prob=rollout,
        tis_mode="icepop",
        tis_cap=HIGH,
        tis_low=LOW,
    )
    loss.backward()
    ratio = torch.exp(old - rollout)
    outside = mask.bool() & ((ratio < LOW) | (ratio > HIGH))
    assert outside.any() and torch.all(lp.grad[outside] == 0)
    inside = mask.bool() & ~outside
    torch.testing.assert_close(lp.grad[inside], -ratio[inside] / mask.sum(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_batch_normalised_weights_average_to_one_and_split_exactly(mode):
    old, rollout, mask = make_batch(1)
    weights, _ = truncated_is_weights(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, tis_mode=mode, tis_cap=1.5
    )
    halves = [slice(0, 4), slice(4, B)]
    split = sum(is_weight_moments(weights[h], mask[h], mode) for h in halves)
    torch.testing.assert_close(split, is_weight_moments(weights, mask, mode), rtol=0, atol=1e-12)
    normalised, metrics = normalize_is_weights(weights, split)
    w, m = normalised.tolist(), mask.tolist()
    if mode == "token":
        mean = statistics.fmean(w[b][t] for b, ts in enumerate(rows(m)) for t in ts)
    else:  # one weight per non-empty sequence
        mean = statistics.fmean(w[b][ts[0]] for b, ts in enumerate(rows(m)) if ts)
    assert math.isclose(mean, 1.0, abs_tol=1e-12)
    raw = weights.tolist()
    seq_raw = [raw[b][ts[0]] for b, ts in enumerate(rows(m)) if ts]
    token_raw = [raw[b][t] for b, ts in enumerate(rows(m)) for t in ts]
    factor = statistics.fmean(token_raw if mode == "token" else seq_raw)
    assert math.isclose(metrics["tis_batch_norm_factor"].item(), factor, rel_tol=1e-12)


def ref_keep(old, rollout, mask, mode):
    lo, hi = math.log(LOW), math.log(HIGH)
    o, r, m = old.tolist(), rollout.tolist(), mask.tolist()
    keep = [[0.0] * T for _ in range(B)]
    for b, ts in enumerate(rows(m)):
        lrs = [o[b][t] - r[b][t] for t in ts]
        if mode == "token":
            for t, lr in zip(ts, lrs):
                keep[b][t] = float(lo <= lr <= hi)
            continue
        if not ts:
            continue
        if mode == "seq_sum":
            stat_ok = lo <= sum(lrs) <= hi
        elif mode == "seq_mean":
            stat_ok = lo <= sum(lrs) / len(lrs) <= hi
        else:  # seq_max: the most extreme token decides
            stat_ok = all(lo <= lr <= hi for lr in lrs)
        for t in ts:
            keep[b][t] = float(stat_ok)
    return torch.tensor(keep, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["token", "seq_sum", "seq_mean", "seq_max"])
def test_rejection_sampling_matches_loop_reference(mode):
    old, rollout, mask = make_batch(2)
    rollout[0], rollout[1] = old[0] + 0.01, old[1] - 0.005
    rollout[2] = old[2] - 0.5  # a row off on every token: rejected by every mode
    kept, metrics = rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, mode=mode, low=LOW, high=HIGH
    )
    want = ref_keep(old, rollout, mask, mode)
    torch.testing.assert_close(kept, want, rtol=0, atol=0)
    n_tokens, n_seqs = mask.sum().item(), mask.bool().any(-1).sum().item()
    rejected_tokens = (mask - want).sum().item()
    rejected_seqs = ((mask - want).sum(-1) > 0).sum().item()
    assert 0 < rejected_tokens < n_tokens  # some rows pass, some do not
    assert math.isclose(metrics["rollout_rs/token_frac"].item(), rejected_tokens / n_tokens, abs_tol=1e-6)
    assert math.isclose(metrics["rollout_rs/seq_frac"].item(), rejected_seqs / n_seqs, abs_tol=1e-12)


def test_rejection_bounds_are_checked():
    old, rollout, mask = make_batch()
    with pytest.raises(ValueError, match="rollout_rs_low"):
        rejection_mask(
            old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, mode="token", low=1.2, high=2
        )
    with pytest.raises(ValueError, match="seq_max"):
        rejection_mask(
            old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, mode="seq_min", low=0.5, high=2
        )


def ref_diagnostics(old, rollout, mask):
    o, r, m = old.tolist(), rollout.tolist(), mask.tolist()
    w = [math.exp(o[b][t] - r[b][t]) for b, ts in enumerate(rows(m)) for t in ts]
    seqs = [ts for ts in rows(m) if ts]
    idx = [b for b, ts in enumerate(rows(m)) if ts]
    seq_w2 = [math.exp(2 * sum(o[b][t] - r[b][t] for t in rows(m)[b])) for b in idx]
    mean_o = [statistics.fmean(o[b][t] for t in rows(m)[b]) for b in idx]
    mean_r = [statistics.fmean(r[b][t] for t in rows(m)[b]) for b in idx]
    assert len(seqs) == len(idx)
    return {
        "rollout_corr/ess": statistics.fmean(w) ** 2 / statistics.fmean(x * x for x in w),
        "rollout_corr/chi2_token": statistics.fmean(x * x for x in w) - 1,
        "rollout_corr/chi2_seq": statistics.fmean(seq_w2) - 1,
        "rollout_corr/training_ppl": statistics.fmean(math.exp(-x) for x in mean_o),
        "rollout_corr/rollout_ppl": statistics.fmean(math.exp(-x) for x in mean_r),
        "rollout_corr/log_ppl_diff": statistics.fmean(a - b for a, b in zip(mean_r, mean_o)),
    }


def test_off_policy_diagnostics_match_loop_reference_and_split_exactly():
    old, rollout, mask = make_batch(3)
    whole = off_policy_moments(old_log_prob=old, rollout_log_prob=rollout, response_mask=mask)
    halves = [slice(0, 5), slice(5, B)]
    split = sum(
        off_policy_moments(old_log_prob=old[h], rollout_log_prob=rollout[h], response_mask=mask[h])
        for h in halves
    )
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    got, want = off_policy_metrics(whole), ref_diagnostics(old, rollout, mask)
    assert got.keys() == want.keys()
    for key in want:
        assert math.isclose(got[key].item(), want[key], rel_tol=1e-10, abs_tol=1e-12), key
    assert 0 < got["rollout_corr/ess"] < 1 and got["rollout_corr/chi2_token"] > 0


def test_on_policy_diagnostics_are_neutral():
    old, _, mask = make_batch(4)
    metrics = off_policy_metrics(
        off_policy_moments(old_log_prob=old, rollout_log_prob=old, response_mask=mask)
    )
    assert math.isclose(metrics["rollout_corr/ess"].item(), 1.0, abs_tol=1e-12)
    assert (
        abs(metrics["rollout_corr/chi2_token"].item()) < 1e-12
        and abs(metrics["rollout_corr/chi2_seq"].item()) < 1e-12
    )
    assert math.isclose(
        metrics["rollout_corr/training_ppl"].item(), metrics["rollout_corr/rollout_ppl"].item()
    )
