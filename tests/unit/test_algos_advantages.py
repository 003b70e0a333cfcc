"""Advantage estimators against plain float64 loop references (random inputs and masks, edge cases)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from megatron_rl.algos import get_advantage_estimator, get_estimator_traits

B, T = 14, 7
# Groups: a random group of 4, an all-equal group of 3, a singleton, a group of 4 holding empty responses,
# a pair; interleaved so that groups are not contiguous.
GROUPS = ["a", "b", "c", "d", "a", "b", "e", "d", "a", "b", "d", "a", "d", "e"]


def make_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[[3, 10]] = 0  # empty responses (in group "d")
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    scores[[1, 5, 9]] = 0.5  # group "b": all-equal rewards
    rewards = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        rewards[b, max(int(lengths[b]) - 1, 0)] = scores[b]  # reward on the last response token
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    return rewards, mask, values


def ref_whiten(x, mask):
    tokens = [x[b][t] for b in range(B) for t in range(T) if mask[b][t]]
    mean = sum(tokens) / len(tokens)
    var = sum((v - mean) ** 2 for v in tokens) / (len(tokens) - 1)
    return [
        [(x[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b][t] else 0.0 for t in range(T)] for b in range(B)
    ]


def ref_scores(rewards):
    return [sum(row) for row in rewards.tolist()]


def ref_broadcast(per_sample, mask):
    return [[per_sample[b] if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]


def ref_gae(rewards, values, mask, gamma, lam):
    r, v, m = rewards.tolist(), values.tolist(), mask.tolist()
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_value, last = 0.0, 0.0
        for t in reversed(range(T)):
            if m[b][t]:
                last = r[b][t] + gamma * next_value - v[b][t] + gamma * lam * last
                next_value = v[b][t]
                adv[b][t] = last
    returns = [[adv[b][t] + v[b][t] if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return ref_whiten(adv, m), returns


def ref_grpo(rewards, mask, epsilon, norm):
    s = ref_scores(rewards)
    out = []
    for b in range(B):
        group = [s[i] for i in range(B) if GROUPS[i] == GROUPS[b]]
        mean, std = (0.0, 1.0) if len(group) == 1 else (statistics.fmean(group), statistics.stdev(group))
        out.append((s[b] - mean) / (std + epsilon) if norm else s[b] - mean)
    adv = ref_broadcast(out, mask.tolist())
    return adv, adv


def ref_rloo(rewards, mask):
    s = ref_scores(rewards)
    out = []
    for b in range(B):
        others = [s[i] for i in range(B) if GROUPS[i] == GROUPS[b] and i != b]
        out.append(s[b] - statistics.fmean(others) if others else s[b])
    adv = ref_broadcast(out, mask.tolist())
    return adv, adv


def ref_reinforce_pp(rewards, mask, gamma):
    r, m = rewards.tolist(), mask.tolist()
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            running = r[b][t] + gamma * running if m[b][t] else 0.0
            returns[b][t] = running
    return ref_whiten(returns, m), returns


def ref_reinforce_pp_baseline(rewards, mask):
    s = ref_scores(rewards)
    out = []
    for b in range(B):
        group = [s[i] for i in range(B) if GROUPS[i] == GROUPS[b]]
        out.append(s[b] - (statistics.fmean(group) if len(group) > 1 else 0.0))
    adv = ref_whiten(ref_broadcast(out, mask.tolist()), mask.tolist())
    return adv, adv


CASES = {
    "gae": lambda r, m, v: ref_gae(r, v, m, gamma=0.9, lam=0.8),
    "grpo": lambda r, m, v: ref_grpo(r, m, epsilon=1e-6, norm=True),
    "rloo": lambda r, m, v: ref_rloo(r, m),
    "reinforce_plus_plus": lambda r, m, v: ref_reinforce_pp(r, m, gamma=0.9),
    "reinforce_plus_plus_baseline": lambda r, m, v: ref_reinforce_pp_baseline(r, m),
}
KWARGS = dict(gamma=0.9, lam=0.8, epsilon=1e-6, norm_adv_by_std=True, unused_key="ignored")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_estimator_matches_loop_reference(name, seed):
    rewards, mask, values = make_batch(seed)
    adv, ret = get_advantage_estimator(name)(
        token_level_rewards=rewards, response_mask=mask, index=GROUPS, values=values, **KWARGS
    )
    ref_adv, ref_ret = CASES[name](rewards, mask, values)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=1e-10)


def test_dr_grpo_is_mean_centred_only():
    rewards, mask, _ = make_batch(3)
    adv, _ = get_advantage_estimator("grpo")(
        token_level_rewards=rewards, response_mask=mask, index=GROUPS, norm_adv_by_std=False
    )
    ref_adv, _ = ref_grpo(rewards, mask, epsilon=1e-6, norm=False)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-12)


def test_grpo_edge_cases():
    rewards, mask, _ = make_batch(4)
    adv, _ = get_advantage_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=GROUPS)
    scores = rewards.sum(-1)
    singleton = GROUPS.index("c")
    assert torch.allclose(adv[singleton, mask[singleton].bool()], scores[singleton] / (1 + 1e-6))
    assert torch.all(adv[[1, 5, 9]] == 0)  # all-equal group: zero advantage, no nan
    assert torch.all(adv[[3, 10]] == 0)  # empty responses
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_index_types_agree(name):
    rewards, mask, _ = make_batch(5)
    codes = {k: i * 7 for i, k in enumerate(sorted(set(GROUPS)))}
    fn = get_advantage_estimator(name)
    as_list, _ = fn(token_level_rewards=rewards, response_mask=mask, index=GROUPS)
    as_np, _ = fn(token_level_rewards=rewards, response_mask=mask, index=np.array([codes[g] for g in GROUPS]))
    as_tensor, _ = fn(
        token_level_rewards=rewards, response_mask=mask, index=torch.tensor([codes[g] for g in GROUPS])
    )
    torch.testing.assert_close(as_np, as_list, rtol=0, atol=0)
    torch.testing.assert_close(as_tensor, as_list, rtol=0, atol=0)


def test_registry_traits_and_errors():
    assert get_estimator_traits("gae").whitened and not get_estimator_traits("gae").grouped
    assert get_estimator_traits("grpo").grouped and not get_estimator_traits("grpo").whitened
    assert get_estimator_traits("reinforce_plus_plus_baseline") == get_estimator_traits(
        "reinforce_plus_plus_baseline"
    )
    with pytest.raises(ValueError, match="grpo"):
        get_advantage_estimator("nope")
