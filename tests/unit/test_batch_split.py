"""Dynamic batch size: micro-batches by token budget."""

import pytest
import torch

from megatron_rl.rollout.batch import RolloutBatch, split_by_tokens


def _batch(prompt_lens, response_lens, r=6) -> RolloutBatch:
    p, q = torch.tensor(prompt_lens), torch.tensor(response_lens)
    n, t = len(p), int((p + q).max())
    j = torch.arange(r)
    return RolloutBatch(
        input_ids=torch.arange(n * t).view(n, t), responses=torch.zeros(n, r, dtype=torch.long),
        response_mask=(j < q[:, None]).float(), score_pos=(p[:, None] - 1 + j).clamp(max=t - 1),
        prompt_lens=p, response_lens=q, group_index=torch.arange(n), rollout_log_probs=torch.zeros(n, r),
        finish_reasons=["length"] * n, rows=list(range(n)),
    )  # fmt: skip


def test_split_by_tokens_respects_the_budget_and_returns_a_permutation():
    batch = _batch([3, 9, 2, 5, 4, 1, 7], [6, 1, 2, 6, 3, 1, 5])  # lengths 9 10 4 11 7 2 12
    mbs, order = split_by_tokens(batch, max_tokens=24)
    assert sorted(order) == list(range(7))
    assert [row for mb in mbs for row in mb.rows] == order  # rows carried in that order
    lengths = (batch.prompt_lens + batch.response_lens)[order].tolist()
    assert lengths == sorted(lengths, reverse=True)  # longest first
    for mb in mbs:
        real = int((mb.prompt_lens + mb.response_lens).max())
        assert mb.seq_len == real and len(mb) * real <= 24  # trimmed to its longest, within budget
        assert int(mb.score_pos.max()) <= real - 1
        assert torch.equal(mb.input_ids, batch.input_ids[mb.rows][:, :real])
    assert [len(mb) for mb in mbs] == [2, 2, 3]  # [12, 11] [10, 9] [7, 4, 2]: 24, 20, 21 padded tokens


def test_split_by_tokens_gives_an_overlong_sequence_its_own_micro_batch():
    mbs, order = split_by_tokens(_batch([20, 2], [5, 1]), max_tokens=10)
    assert [len(mb) for mb in mbs] == [1, 1] and order == [0, 1]


def test_deferred_fields_follow_select_and_trim_and_resolve_once():
    """``reward.overlap``: micro-batches carry the batch's advantages / returns as ``Deferred`` views through
    every split (rows picked and reordered, columns trimmed); resolving computes the batch's fields once and
    gives each micro-batch exactly the rows and columns the computed-first split would hold."""
    from megatron_rl.rollout.batch import Deferred, Pending, resolved
    from megatron_rl.rollout.packing import split_packed
    from megatron_rl.rollout.shared_prompts import split_shared

    def filled(batch):
        g = torch.Generator().manual_seed(0)
        batch.advantages = torch.randn(len(batch), batch.responses.shape[1], generator=g)
        batch.returns = batch.advantages * 2 + 1

    for split in (split_by_tokens, split_packed, split_shared):
        eager = _batch([3, 9, 2, 5, 4, 1, 7], [6, 1, 2, 6, 3, 1, 5])
        eager.group_index = torch.tensor([0, 0, 1, 1, 2, 2, 3])
        lazy = _batch([3, 9, 2, 5, 4, 1, 7], [6, 1, 2, 6, 3, 1, 5])
        lazy.group_index = eager.group_index.clone()
        filled(eager)
        calls = []
        pending = Pending(
            lazy, lambda calls=calls, lazy=lazy: (calls.append(1), filled(lazy)), ("advantages", "returns")
        )
        assert isinstance(lazy.advantages, Deferred) and isinstance(lazy.returns, Deferred)
        want, _ = split(eager, 24, None) if split is not split_by_tokens else split(eager, 24)
        got, _ = split(lazy, 24, None) if split is not split_by_tokens else split(lazy, 24)
        sub = got[0].select([1, 0])  # a selection of a selection composes
        assert calls == []
        assert len(got) == len(want) > 1
        for w, m in zip(want, got, strict=True):
            assert isinstance(m.advantages, Deferred)
            assert torch.equal(resolved(m.advantages), w.advantages) and torch.equal(
                resolved(m.returns), w.returns
            )
        assert calls == [1] and pending.done  # computed once, for the whole batch
        assert torch.equal(resolved(sub.advantages), want[0].advantages[[1, 0]])
        assert torch.equal(lazy.advantages, eager.advantages)  # the batch now holds the real tensors
    with pytest.raises(TypeError, match=r"\[:, :r\]"):
        Deferred(pending, "advantages")[:, 1:3]
