"""The collective layer on a single process (group None): same results as the pure functions."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algos import (
    all_reduce_metrics,
    compute_advantages_dp,
    get_advantage_estimator,
    global_loss_denominators,
)

B, T = 6, 5
GROUPS = [0, 1, 0, 2, 1, 0]


def make_batch():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(T)[None, :] < torch.tensor([5, 3, 0, 2, 4, 1])[:, None]).to(torch.float64)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64) * mask
    return rewards, mask, torch.randn(B, T, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize(
    "name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
)
def test_single_process_matches_pure_estimator(name):
    rewards, mask, values = make_batch()
    kwargs = dict(token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.95)
    got = compute_advantages_dp(name, dp_group=None, index=GROUPS, **kwargs)
    want = get_advantage_estimator(name)(index=GROUPS, **kwargs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_grouped_estimator_without_index_raises():
    rewards, mask, _ = make_batch()
    with pytest.raises(ValueError, match="index"):
        compute_advantages_dp("grpo", dp_group=None, token_level_rewards=rewards, response_mask=mask)


def test_denominators_and_metrics_single_process():
    _, mask, _ = make_batch()
    tokens, seqs = global_loss_denominators([mask[:2], mask[2:]], None)
    assert tokens.item() == 15 and seqs.item() == 5  # the empty response does not count
    out = all_reduce_metrics(
        {"a": torch.tensor(0.25), "b": torch.tensor(3.0)}, None, weight=tokens, reduce_ops={"b": "max"}
    )
    assert out["a"].item() == 0.25 and out["b"].item() == 3.0
    with pytest.raises(ValueError, match="mean"):
        all_reduce_metrics({"a": torch.tensor(1.0)}, None, reduce_ops={"a": "median"})
