"""CISPO, SAPO, GMPO, Clip-Cov, KL-Cov, DPPO and GPG losses against float64 loop references (values and
gradients), on masks with interior gaps (multi-turn tool tokens): gap tokens never count."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import compute_policy_loss, get_policy_loss, policy_loss_names

B, T = 8, 7
LOW, HIGH, C = 0.2, 0.28, 3.0


def make_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    old_log_prob = (log_prob - 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    advantages = torch.randn(B, T, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[2], lengths[0] = 0, T  # an empty response; a full one
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    mask[lengths >= 5, 2:4] = 0.0  # tool output inside the response
    return log_prob, old_log_prob, advantages, mask


def token_mean_loss(loss, mask):
    kept = [loss[b][t] for b in range(B) for t in range(T) if mask[b][t]]
    return sum(kept) / len(kept)


def run(name, seed=0, mode="token-mean", **kwargs):
    lp, old, adv, mask = make_batch(seed)
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        name,
        old_log_prob=old,
        log_prob=leaf,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        **kwargs,
    )
    loss.backward()
    return loss, metrics, leaf.grad, (lp.tolist(), old.tolist(), adv.tolist(), mask.tolist())


def per_token(fn, lp, old, adv, m):
    """``fn(lp, old, a) -> (loss, dloss/dlp)`` on every response token; token-mean value and gradient."""
    n = sum(map(sum, m))
    loss, grad = [[0.0] * T for _ in range(B)], torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if m[b][t]:
                loss[b][t], g = fn(lp[b][t], old[b][t], adv[b][t])
                grad[b, t] = g / n
    return token_mean_loss(loss, m), grad


def check(name, ref, seed=0, **kwargs):
    loss, metrics, grad, (lp, old, adv, m) = run(name, seed, **kwargs)
    want_loss, want_grad = per_token(ref, lp, old, adv, m)
    assert math.isclose(loss.item(), want_loss, abs_tol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert grad[torch.tensor(m) == 0].abs().max() == 0  # gap and padding tokens get no gradient
    return metrics


def test_cispo():
    def ref(lp, old, a):
        w = min(max(math.exp(lp - old), 1 - LOW), 1 + HIGH)
        return -w * a * lp, -w * a

    metrics = check("cispo", ref, clip_ratio_low=LOW, clip_ratio_high=HIGH)
    assert 0 < metrics["pg_clipfrac"] < 1


def test_sapo():
    def ref(lp, old, a, tau_pos=1.0, tau_neg=1.05):
        r, tau = math.exp(lp - old), tau_pos if a > 0 else tau_neg
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        return -a * sig * 4 / tau, -a * 4 * sig * (1 - sig) * r

    check("sapo", ref, tau_pos=1.0, tau_neg=1.05)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo(name):
    def ref(lp, old, a):
        p, q = math.exp(lp), math.exp(old)
        if name == "dppo_tv":
            inside = p - q <= HIGH if a > 0 else p - q >= -LOW
        else:
            kl = q * (math.log(q + 1e-8) - math.log(p + 1e-8)) + (1 - q) * math.log(
                (1 - q + 1e-8) / (1 - p + 1e-8)
            )
            inside = (kl <= HIGH or p <= q) if a > 0 else (kl <= LOW or p >= q)
        w = min(math.exp(lp - old), C)
        return (-a * w * lp, -a * w) if inside else (0.0, 0.0)

    metrics = check(name, ref, clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C)
    assert 0 < metrics["pg_clipfrac"] < 1, metrics  # some tokens are outside the trust region


def test_gpg_loss():
    check("gpg", lambda lp, old, a: (-a * lp, -a))


def test_gmpo_matches_sequence_level_reference():
    loss, metrics, grad, (lp, old, adv, m) = run(
        "geo_mean", 1, mode="seq-mean-token-mean", clip_ratio_low=LOW, clip_ratio_high=HIGH
    )
    seqs = [b for b in range(B) if any(m[b])]
    want_loss, want_grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for b in seqs:
        tokens = [t for t in range(T) if m[b][t]]
        n, pessimistic, active = len(tokens), [], {}
        for t in tokens:
            lr, s = lp[b][t] - old[b][t], math.copysign(1.0, adv[b][t])
            clamped = min(max(lr, -LOW), HIGH)
            pessimistic.append(s * min(s * lr, s * clamped))
            active[t] = -LOW <= lr <= HIGH or s * lr < s * clamped  # the unclipped term is the one taken
        ratio, a_bar = math.exp(sum(pessimistic) / n), sum(adv[b][t] for t in tokens) / n
        want_loss += -a_bar * ratio / len(seqs)
        for t in tokens:
            want_grad[b, t] = -a_bar * ratio / n * active[t] / len(seqs)
    assert math.isclose(loss.item(), want_loss, abs_tol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert metrics["pg_clipfrac"] + metrics["pg_clipfrac_lower"] > 0


def covariance(lp, adv, m):
    tokens = [(b, t) for b in range(B) for t in range(T) if m[b][t]]
    mean_a = sum(adv[b][t] for b, t in tokens) / len(tokens)
    mean_lp = sum(lp[b][t] for b, t in tokens) / len(tokens)
    return {(b, t): (adv[b][t] - mean_a) * (lp[b][t] - mean_lp) for b, t in tokens}


def test_kl_cov_penalises_the_top_covariance_tokens():
    ratio, coef = 0.2, 0.5
    loss, metrics, grad, (lp, old, adv, m) = run("kl_cov", 2, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    cov = covariance(lp, adv, m)
    k = max(1, math.floor(ratio * len(cov)))
    top = set(sorted(cov, key=lambda bt: -cov[bt])[:k])

    def ref(b, t):
        lr = lp[b][t] - old[b][t]
        value, g = -adv[b][t] * math.exp(lr), -adv[b][t] * math.exp(lr)
        if (b, t) in top:
            value, g = value + coef * abs(lr), g + coef * math.copysign(1.0, lr)
        return value, g

    n = len(cov)
    want_loss = sum(ref(b, t)[0] for b, t in cov) / n
    want_grad = torch.zeros(B, T, dtype=torch.float64)
    for b, t in cov:
        want_grad[b, t] = ref(b, t)[1] / n
    assert k > 1 and math.isclose(metrics["pg_covfrac"].item(), k / n, abs_tol=1e-6)
    assert math.isclose(loss.item(), want_loss, abs_tol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def ppo_token(lp, old, a):
    r = math.exp(lp - old)
    l1, l2 = -a * r, -a * min(max(r, 1 - LOW), 1 + HIGH)
    return max(l1, l2), l2 > l1, (-a * r if l1 >= l2 else 0.0)


@pytest.mark.parametrize("seed", [0, 3])
def test_clip_cov_detaches_a_random_in_range_subset(seed):
    ratio, lb, ub = 0.15, -0.2, 0.6
    kwargs = dict(
        clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub
    )
    gen = torch.Generator().manual_seed(seed)
    loss, metrics, grad, (lp, old, adv, m) = run("clip_cov", 3, generator=gen, **kwargs)
    cov = covariance(lp, adv, m)
    n, k = len(cov), max(1, math.floor(ratio * len(cov)))
    ppo = {(b, t): ppo_token(lp[b][t], old[b][t], adv[b][t]) for b, t in cov}  # (loss, clipped, grad)
    candidates = {bt for bt in cov if lb < cov[bt] < ub and not ppo[bt][1]}
    detached = {bt for bt in cov if grad[bt].item() == 0 and ppo[bt][2] != 0}
    assert len(candidates) > k and len(detached) == k and detached <= candidates
    want_loss = sum(0.0 if bt in detached else ppo[bt][0] for bt in cov) / n
    assert math.isclose(loss.item(), want_loss, abs_tol=1e-12)
    for bt in cov:
        assert math.isclose(grad[bt].item(), 0.0 if bt in detached else ppo[bt][2] / n, abs_tol=1e-12)
    assert math.isclose(metrics["pg_covfrac"].item(), k / n, abs_tol=1e-6)


def test_registry_refuses_a_second_registration_and_lists_every_loss():
    for name in ("cispo", "sapo", "geo_mean", "gmpo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "gpg"):
        assert name in policy_loss_names()
    with pytest.raises(ValueError, match="already registered"):
        from megatron_rl.algos.policy_loss import register_policy_loss

        register_policy_loss("cispo")(lambda **_: None)
    assert get_policy_loss("cispo").__name__ == "cispo_loss"


@pytest.mark.parametrize(
    "mode",
    ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"],
)
def test_aggregation_counts_only_assistant_tokens_across_gaps(mode):
    """A response with a tool output inside: length normalisation counts its mask=1 tokens only."""
    lp, _, _, mask = make_batch(5)
    loss_mat = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    loss_mat[mask == 0] = 1e6  # tool/padding values must never leak in
    got = compute_policy_loss(
        "gpg",
        old_log_prob=lp,
        log_prob=lp,
        advantages=-loss_mat / lp,
        response_mask=mask,
        loss_agg_mode=mode,
        seq_len_norm=10,
    )[0]
    seqs = [[loss_mat[b, t].item() for t in range(T) if mask[b, t]] for b in range(B)]
    seqs = [s for s in seqs if s]
    assert any(mask[b, 2] == 0 and mask[b, 4] == 1 for b in range(B))  # an interior gap is present
    want = {
        "token-mean": sum(map(sum, seqs)) / sum(map(len, seqs)),
        "seq-mean-token-sum": sum(map(sum, seqs)) / len(seqs),
        "seq-mean-token-mean": sum(sum(s) / len(s) for s in seqs) / len(seqs),
        "seq-mean-token-sum-norm": sum(map(sum, seqs)) / (len(seqs) * 10),
        "token-sum": sum(map(sum, seqs)),
    }[mode]
    assert math.isclose(got.item(), want, rel_tol=1e-12)
