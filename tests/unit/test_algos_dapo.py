"""DAPO: group filter, overlong penalty and filter against loop references; dynamic sampling fills the
batch from extra rounds, tops up when the rounds run out, and its metrics count what was dropped."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algos.dapo import informative_groups, overlong_filter, overlong_penalty
from megatron_rl.rollout.batch import RolloutBatch
from megatron_rl.trainer.dynamic_sampling import (
    concat_batches,
    extra_prompt_indices,
    fill_with_informative_groups,
)

N = 3  # samples per prompt


def test_informative_groups_matches_loop_reference():
    index = ["a", "b", "a", "c", "b", "a", "d", "d"]
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 2.0, 2.0], dtype=torch.float64)
    keep, metrics = informative_groups(scores, index)
    want = []
    for g in index:
        group = [s for s, h in zip(scores.tolist(), index) if h == g]
        want.append(len(group) == 1 or len(set(group)) > 1)
    assert keep.tolist() == want == [True, False, True, True, False, True, False, False]
    assert metrics["dynamic_sampling/groups"] == 4 and metrics["dynamic_sampling/kept_groups"] == 2


def test_overlong_penalty_matches_loop_reference():
    lengths = torch.tensor([0, 5, 12, 13, 16, 20])
    got = overlong_penalty(lengths, max_response_length=20, buffer_len=8, penalty_factor=0.5)
    want = [min(0.0, -(n - 12) / 8 * 0.5) for n in lengths.tolist()]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    assert got[-1] == -0.5 and got[2] == 0
    with pytest.raises(ValueError, match="reward.overlong_buffer.len"):
        overlong_penalty(lengths, max_response_length=8, buffer_len=8, penalty_factor=1.0)


def test_overlong_filter_zeroes_truncated_rows_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=torch.float32)
    out = overlong_filter(mask, torch.tensor([False, False, True]))
    assert out.tolist() == [[1, 1, 0], [1, 0, 1], [0, 0, 0]]


def fake_batch(scores: list[float], first_group: int, width: int = 5) -> RolloutBatch:
    """A scored batch of ``len(scores) // N`` groups of N samples (reward on the first token)."""
    b, r = len(scores), 4
    tls = torch.zeros(b, r)
    tls[:, 0] = torch.tensor(scores)
    return RolloutBatch(
        input_ids=torch.full((b, width), 7),
        responses=torch.ones(b, r, dtype=torch.long),
        response_mask=torch.ones(b, r),
        score_pos=torch.zeros(b, r, dtype=torch.long),
        prompt_lens=torch.ones(b, dtype=torch.long),
        response_lens=torch.full((b,), r),
        group_index=torch.tensor([first_group + i // N for i in range(b)]),
        rollout_log_probs=torch.zeros(b, r),
        finish_reasons=["stop"] * b,
        rows=[f"prompt{first_group + i // N}" for i in range(b)],
        response_texts=[f"text{i}" for i in range(b)],
        token_level_scores=tls,
    )


def test_dynamic_sampling_replaces_uninformative_groups_from_extra_rounds():
    first = fake_batch([1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0], 0)  # groups 0 and 2 carry no signal
    rounds = {1: fake_batch([1, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1], 100, width=8)}  # one informative group
    rounds[2] = fake_batch([0, 1, 0, 1, 0, 1, 0, 0, 0, 1, 1, 0], 200)  # three informative groups
    out, metrics = fill_with_informative_groups(first, rounds.__getitem__, 4, pad_id=0, dp_group=None)
    # groups 1 and 3 of the first round, 101 of the second, then the first one of the third
    assert sorted(set(out.group_index.tolist())) == [1, 3, 101, 200]
    assert len(out) == len(first) and out.input_ids.shape[1] == 8 and out.input_ids[0, 5:].eq(0).all()
    assert out.rows[0] == "prompt1" and len(out.response_texts) == len(out)
    assert metrics == {
        "dynamic_sampling/groups": 12.0,
        "dynamic_sampling/kept_groups": 6.0,
        "dynamic_sampling/dropped_groups": 6.0,
        "dynamic_sampling/rounds": 3.0,
        "dynamic_sampling/padded_groups": 0.0,
    }


def test_dynamic_sampling_tops_up_when_the_rounds_run_out():
    first = fake_batch([1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0], 0)
    dull = fake_batch([1.0] * 12, 100)
    out, metrics = fill_with_informative_groups(first, lambda r: dull, 2, pad_id=0, dp_group=None)
    assert len(out) == len(first)
    assert sorted(set(out.group_index.tolist())) == [0, 1, 2, 3]  # the dropped groups come back
    assert metrics["dynamic_sampling/padded_groups"] == 2 and metrics["dynamic_sampling/rounds"] == 2


def test_dynamic_sampling_stops_after_the_first_round_when_every_group_is_informative():
    first = fake_batch([1, 0, 0, 0, 1, 0], 0)
    out, metrics = fill_with_informative_groups(first, lambda r: pytest.fail("no extra round"), 3, 0, None)
    assert out.group_index.tolist() == first.group_index.tolist()
    assert metrics["dynamic_sampling/rounds"] == 1 and metrics["dynamic_sampling/dropped_groups"] == 0


def test_extra_prompts_are_deterministic_and_distinct():
    a = extra_prompt_indices(100, 16, seed=1, step=3, round_=1)
    assert a == extra_prompt_indices(100, 16, seed=1, step=3, round_=1) and len(set(a)) == 16
    assert a != extra_prompt_indices(100, 16, seed=1, step=3, round_=2)


def test_concat_refuses_fields_set_in_some_rounds_only():
    a, b = fake_batch([1, 0, 0], 0), fake_batch([1, 0, 0], 1)
    a.old_log_probs = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="old_log_probs"):
        concat_batches([a, b], 0)
