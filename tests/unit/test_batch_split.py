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


def test_the_update_split_reads_nothing_back_from_the_device():
    """``build_batch`` keeps the host copies of the lengths, group ids and input ids it copies to the device,
    ``select`` and ``trim`` carry them, so the update's splits (shared prompts, packed, by tokens), their
    layouts, ``token_counts`` and ``response_cells`` read nothing back before the first forward (on a GPU,
    a host sync each). On the meta device any read raises; there every split equals the CPU batch's in rows,
    shapes and host-side counts, and the kept copies equal the CPU tensors."""
    import random

    import numpy as np

    from megatron_rl.distributed.transfer import host_values, kept_host
    from megatron_rl.models.pipeline import response_cells
    from megatron_rl.rollout.batch import build_batch
    from megatron_rl.rollout.engine import Completion
    from megatron_rl.rollout.packing import split_packed, token_counts
    from megatron_rl.rollout.shared_prompts import split_shared

    rng = random.Random(3)
    prompts = [[rng.randint(1, 99) for _ in range(rng.randint(2, 9))] for _ in range(5)]
    prompts[4] = list(prompts[1])  # two groups with equal prompts: shared by token equality
    comps = []
    for i in range(20):
        r = rng.choice([0, 1, 4, 7, 8])
        c = Completion(i // 4, i % 4, prompts[i // 4], finish_reason="stop")
        c.set_arrays(
            np.array([rng.randint(1, 99) for _ in range(r)], dtype=np.int64),
            np.random.default_rng(i).random(r, np.float32),
        )
        comps.append(c)
    cpu = build_batch(comps, [None] * 5, 3, 8, 0, torch.device("cpu"))
    meta = build_batch(comps, [None] * 5, 3, 8, 0, torch.device("meta"))
    with pytest.raises(Exception):  # noqa: B017, PT011 - what any read back from the meta device does
        meta.response_lens.tolist()
    for name in ("input_ids", "prompt_lens", "response_lens", "group_index"):
        assert torch.equal(kept_host(getattr(meta, name)), getattr(cpu, name))
    assert kept_host(meta.responses) is None  # only the per-row tensors the split reads keep one
    for split in (split_shared, split_packed, split_by_tokens):
        want, want_order = split(cpu, 40)
        got, got_order = split(meta, 40)
        assert got_order == want_order and len(got) == len(want) > 1
        for g, w in zip(got, want):
            assert g.input_ids.shape == w.input_ids.shape and g.score_pos.shape == w.score_pos.shape
            assert torch.equal(host_values(g.input_ids), w.input_ids)
            assert torch.equal(host_values(g.response_lens), w.response_lens)
            cells = response_cells(g)
            assert (cells is None) == (response_cells(w) is None)
            if cells is not None:
                assert cells.device.type == "meta" and cells.shape == response_cells(w).shape
            if w.packed is not None:
                assert g.packed.total == w.packed.total and g.packed.max_seqlen == w.packed.max_seqlen
                assert g.packed.cu_seqlens.shape == w.packed.cu_seqlens.shape
                if w.packed.shared:
                    assert g.packed.real == w.packed.real and g.packed.max_seqlen_k == w.packed.max_seqlen_k
        assert token_counts(got) == token_counts(want)
    # DAPO's rounds concatenated (input ids padded to the longest) keep them too
    from megatron_rl.trainer.dynamic_sampling import concat_batches

    short = build_batch(comps[:4], [None] * 5, 3, 8, 0, torch.device("meta"))
    both, want = (
        concat_batches([short, meta], 5),
        concat_batches([build_batch(comps[:4], [None] * 5, 3, 8, 0, torch.device("cpu")), cpu], 5),
    )
    for name in ("input_ids", "prompt_lens", "response_lens", "group_index"):
        assert torch.equal(kept_host(getattr(both, name)), getattr(want, name))
    assert split_shared(both, 40)[1] == split_shared(want, 40)[1]


def test_a_kept_host_copy_is_ignored_once_its_tensor_changes_in_place():
    """``keep_host``'s copy stands for the tensor only while the tensor's version is the one it was kept at:
    an in-place write (to it or a view of it) drops it, and ``host_values`` reads the device again."""
    from megatron_rl.distributed.transfer import host_copy, host_values, keep_host, kept_host, to_device_async

    host = torch.arange(6)
    dev = to_device_async(host, torch.device("meta"), keep=True)
    assert kept_host(dev) is host and host_copy(dev) is host and host_values(dev) is host
    dev[:2].zero_()  # through a view: the same version counter
    assert kept_host(dev) is None and host_copy(dev) is None
    same = to_device_async(dev, torch.device("meta"), keep=True)  # already there: no copy of itself kept
    assert same is dev and host_copy(same) is None
    cpu = keep_host(torch.ones(2), torch.zeros(2))  # on the CPU the tensor is its own host copy
    assert kept_host(cpu) is cpu and host_copy(cpu) is None
