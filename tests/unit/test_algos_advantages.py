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


def make_batch(seed: int, gaps: bool = False):
    """Random rewards/mask/values. ``gaps``: multi-turn responses, i.e. interior zeros in the mask (tool
    and user tokens) and some reward on a masked token (a tool's reward)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[[3, 10]] = 0  # empty responses (in group "d")
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    scores[[1, 5, 9]] = 0.5  # group "b": all-equal rewards
    rewards = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        rewards[b, max(int(lengths[b]) - 1, 0)] = scores[b]  # reward on the last response token
    if gaps:
        for b in range(B):
            n = int(lengths[b])
            if n >= 4:  # turn 1, a tool output of 1-2 tokens, turn 2 (at least one token each side)
                start = int(torch.randint(1, n - 2, (1,), generator=gen))
                mask[b, start : start + 1 + (n - start > 3)] = 0
        rewards[0, 2], mask[0, 1:3] = 0.25, 0.0  # a tool reward inside the gap (row 0 has 7 tokens)
        rewards[0, 6] = 1.0
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
    """Over the mask=1 tokens only, in order; rewards at masked positions join the assistant token
    before them (trailing ones after the last token join the last token)."""
    r, v, m = rewards.tolist(), values.tolist(), mask.tolist()
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        steps = [t for t in range(T) if m[b][t]]
        next_value, last = 0.0, 0.0
        for k in reversed(range(len(steps))):
            t, t_next = steps[k], (steps[k + 1] if k + 1 < len(steps) else T)
            reward = sum(r[b][t:t_next])  # r[t] plus the rewards of the gap after t
            last = reward + gamma * next_value - v[b][t] + gamma * lam * last
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
    """Return-to-go over the mask=1 tokens only (the same step structure as ``ref_gae``)."""
    r, m = rewards.tolist(), mask.tolist()
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        steps = [t for t in range(T) if m[b][t]]
        running = 0.0
        for k in reversed(range(len(steps))):
            t, t_next = steps[k], (steps[k + 1] if k + 1 < len(steps) else T)
            running = sum(r[b][t:t_next]) + gamma * running
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


def ref_opo(rewards, mask):
    s, lengths = ref_scores(rewards), [sum(row) for row in mask.tolist()]
    out = []
    for b in range(B):
        members = [i for i in range(B) if GROUPS[i] == GROUPS[b]]
        if len(members) == 1:
            out.append(s[b])
            continue
        total_len = sum(lengths[i] for i in members)
        baseline = sum(lengths[i] * s[i] for i in members) / total_len if total_len else 0.0
        out.append(s[b] - baseline)
    adv = ref_broadcast(out, mask.tolist())
    return adv, adv


def ref_gpg(rewards, mask):
    s = ref_scores(rewards)
    alpha = B / max(sum(1 for v in s if v != 0), 1)
    out = []
    for b in range(B):
        group = [s[i] for i in range(B) if GROUPS[i] == GROUPS[b]]
        out.append(alpha * (s[b] - (statistics.fmean(group) if len(group) > 1 else 0.0)))
    adv = ref_broadcast(out, mask.tolist())
    return adv, adv


def ref_remax(rewards, mask, baselines):
    r, m = rewards.tolist(), mask.tolist()
    ret = [[sum(r[b][t:]) if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    adv = [[ret[b][t] - baselines[b] if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return adv, ret


BASELINES = [0.1 * i - 0.5 for i in range(B)]  # ReMax: the greedy sample's score per row
CASES = {
    "opo": lambda r, m, v: ref_opo(r, m),
    "gpg": lambda r, m, v: ref_gpg(r, m),
    "remax": lambda r, m, v: ref_remax(r, m, BASELINES),
    "gae": lambda r, m, v: ref_gae(r, v, m, gamma=0.9, lam=0.8),
    "grpo": lambda r, m, v: ref_grpo(r, m, epsilon=1e-6, norm=True),
    "rloo": lambda r, m, v: ref_rloo(r, m),
    "reinforce_plus_plus": lambda r, m, v: ref_reinforce_pp(r, m, gamma=0.9),
    "reinforce_plus_plus_baseline": lambda r, m, v: ref_reinforce_pp_baseline(r, m),
}
KWARGS = dict(gamma=0.9, lam=0.8, epsilon=1e-6, norm_adv_by_std=True, unused_key="ignored")
KWARGS["reward_baselines"] = torch.tensor(BASELINES, dtype=torch.float64)


@pytest.mark.parametrize("gaps", [False, True], ids=["single_turn", "interior_gaps"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_estimator_matches_loop_reference(name, seed, gaps):
    rewards, mask, values = make_batch(seed, gaps)
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


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg"])
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


@pytest.mark.parametrize("name", sorted(CASES))
def test_final_reward_reaches_the_first_turn(name):
    """One response of three turns separated by tool tokens, reward 1 on the last token: every assistant
    token gets a non-zero return/advantage, tool tokens get exactly 0."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.float64)
    rewards = torch.zeros(2, 8, dtype=torch.float64)
    rewards[:, 7] = torch.tensor([1.0, 0.0], dtype=torch.float64)
    values = torch.zeros(2, 8, dtype=torch.float64)
    adv, ret = get_advantage_estimator(name)(
        token_level_rewards=rewards,
        response_mask=mask,
        index=[0, 0],
        values=values,
        gamma=0.9,
        lam=0.8,
        reward_baselines=torch.zeros(2, dtype=torch.float64),
    )
    assert torch.all(ret[0, mask[0].bool()] != 0), ret
    assert torch.all(adv[0, mask[0].bool()] != 0), adv
    assert torch.all(adv[0, ~mask[0].bool()] == 0) and torch.all(ret[0, ~mask[0].bool()] == 0)
    # 5 assistant steps (0, 1, 4, 5, 7): turn 1 is 4 steps before the reward, the gaps are not steps
    expected = {"gae": (0.9 * 0.8) ** 4, "reinforce_plus_plus": 0.9**4}
    if name in expected:
        torch.testing.assert_close(ret[0, 0], torch.tensor(expected[name], dtype=torch.float64))


PASSK_GROUPS = [0, 1, 0, 2, 1, 0, 2, 1, 0, 2, 1, 2, 0, 1]  # groups of 5, 5, 4; rows interleaved


def ref_passk(rewards, mask, epsilon, norm):
    s, out = ref_scores(rewards), [0.0] * B
    for g in set(PASSK_GROUPS):
        members = [i for i in range(B) if PASSK_GROUPS[i] == g]
        ranked = sorted(members, key=lambda i: (-s[i], i))  # best first, first row on ties
        gap = s[ranked[0]] - s[ranked[1]]
        out[ranked[0]] = gap / (statistics.stdev([s[i] for i in members]) + epsilon) if norm else gap
    return ref_broadcast(out, mask.tolist())


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("gaps", [False, True])
def test_grpo_passk_matches_loop_reference(norm, gaps):
    rewards, mask, _ = make_batch(7, gaps)
    rewards[0, 6], rewards[2, :] = 2.0, 0.0  # a clear winner in group 0; ...
    rewards[2, 0] = 2.0  # ... and a tie for it (row 0 comes first)
    adv, ret = get_advantage_estimator("grpo_passk")(
        token_level_rewards=rewards, response_mask=mask, index=PASSK_GROUPS, norm_adv_by_std=norm
    )
    want = torch.tensor(ref_passk(rewards, mask, 1e-6, norm), dtype=torch.float64)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, want, rtol=0, atol=1e-12)
    assert (adv.abs().sum(-1) > 0).sum() <= 3  # at most one sample per group


def test_grpo_passk_needs_two_samples_per_group():
    rewards, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="rollout.n"):
        get_advantage_estimator("grpo_passk")(token_level_rewards=rewards, response_mask=mask, index=GROUPS)
