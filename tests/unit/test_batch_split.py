"""Dynamic batch size: micro-batches by token budget."""

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
