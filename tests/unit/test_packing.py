"""Packed micro-batches on CPU: the grouping and padded-fraction arithmetic, the THD layout and its inverse,
per-sequence attention and RoPE positions that restart per sequence."""

import pytest
import torch

from megatron_rl.kernels.rope import fused_apply_rotary_pos_emb_thd, rope_reference
from megatron_rl.models.packed_attention import _varlen_kwargs, packed_attention, segment_attention
from megatron_rl.rollout.batch import packed_groups, padded_fraction, token_budget_groups
from megatron_rl.rollout.packing import pad_layout, split_packed, token_counts, unpack
from tests.unit.test_batch_split import _batch


def test_padded_fraction_of_the_trainers_split_and_of_packing():
    lengths = [12, 11, 10, 9, 7, 4, 2]
    groups = token_budget_groups(lengths, 24)
    assert groups == [[0, 1], [2, 3], [4, 5, 6]]  # padded 24 + 20 + 21 = 65 for 55 real tokens
    assert padded_fraction(lengths, groups) == pytest.approx(1 - 55 / 65)
    packed = packed_groups(lengths, 24)
    assert packed == [[0, 1], [2, 3], [4, 5, 6]] and all(sum(lengths[i] for i in g) <= 24 for g in packed)
    assert padded_fraction(lengths, packed, packed=True) == 0.0
    assert packed_groups([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert len(packed_groups([10, 7, 7, 6, 5, 5, 5], 24)) < len(
        token_budget_groups([10, 7, 7, 6, 5, 5, 5], 24)
    )


def test_pack_layout_keeps_real_tokens_and_points_score_pos_into_the_row():
    batch = _batch([3, 1, 2], [2, 4, 1])  # lengths 5 5 3
    (mb,), order = split_packed(batch, max_tokens=100)
    lay = mb.packed
    assert lay.total == 13 and lay.cu_seqlens.tolist() == [0, 5, 10, 13] and lay.max_seqlen == 5
    assert order == [0, 1, 2] and token_counts([mb]) == (13, 13, 13)
    for b, (a, e) in enumerate([(0, 5), (5, 10), (10, 13)]):
        n = int(mb.prompt_lens[b] + mb.response_lens[b])
        assert torch.equal(lay.input_ids[0, a:e], mb.input_ids[b, :n])
        assert lay.positions[0, a:e].tolist() == list(range(n))
        real = mb.response_mask[b].bool()  # a real response position scores the same token as in the rows
        assert torch.equal(lay.input_ids[0][lay.score_pos[b][real]], mb.input_ids[b][mb.score_pos[b][real]])
    assert int(lay.score_pos.max()) <= 12
    rows = unpack(torch.arange(13.0)[None, :, None], lay, mb.seq_len)  # [B, T, 1] back in row layout
    assert rows[1, :5, 0].tolist() == [5, 6, 7, 8, 9]
    padded = pad_layout(lay, 4)
    assert padded.total == 16 and padded.cu_seqlens.tolist() == [0, 5, 10, 13, 16]


def test_pack_layout_equals_the_boolean_mask_packing_it_replaced():
    """``pack_layout`` builds its indices on the host from the lengths (session 40); over random rows (empty
    rows, full rows, int32 / int64 lengths) it gives what the device-side boolean mask gave, dtypes included,
    and a length past the rows' width stops it (the mask dropped such tokens while ``cu_seqlens`` counted them)."""
    from megatron_rl.rollout.packing import pack_layout

    g = torch.Generator().manual_seed(0)
    for case in range(60):
        b, t, r = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g)), 4
        lengths = torch.randint(0, t + 1, (b,), generator=g).to(torch.int32 if case % 2 else torch.int64)
        ids = torch.randint(0, 99, (b, t), generator=g)
        score_pos = torch.randint(0, t, (b, r), generator=g)
        keep = torch.arange(t)[None, :] < lengths[:, None]  # the replaced implementation, on one device
        cu = torch.zeros(b + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        lay = pack_layout(ids, lengths, score_pos)
        assert torch.equal(lay.input_ids, ids[keep][None]) and lay.input_ids.dtype == ids.dtype
        assert torch.equal(lay.positions, torch.arange(t).expand(b, t)[keep][None])
        assert torch.equal(lay.cu_seqlens, cu) and torch.equal(lay.starts, cu[:-1].long())
        assert lay.max_seqlen == int(lengths.max())
        assert torch.equal(lay.score_pos, (score_pos + cu[:-1].long()[:, None]).clamp(max=int(cu[-1]) - 1))
    with pytest.raises(ValueError, match="a sequence of 5 tokens in rows of 4"):
        pack_layout(
            torch.zeros(2, 4, dtype=torch.long), torch.tensor([2, 5]), torch.zeros(2, 1, dtype=torch.long)
        )


def test_packed_attention_equals_each_sequence_alone_and_ignores_its_neighbours():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(11, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))  # GQA 4 / 2
    cu = torch.tensor([0, 4, 9, 11], dtype=torch.int32)
    out = packed_attention(q, k, v, cu, 5, 0.3, None)
    for a, b in [(0, 4), (4, 9), (9, 11)]:
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, enable_gqa=True, scale=0.3
        )[0].transpose(0, 1)
        assert torch.allclose(out[a:b], alone, atol=1e-12)
    k2 = k.clone()
    k2[:4] += 1.0  # a change in the first sequence's keys moves no other sequence's output
    assert torch.equal(packed_attention(q, k2, v, cu, 5, 0.3, None)[4:], out[4:])
    windowed = segment_attention(q, k, v, cu, 0.3, window=1)  # each query sees itself and one back
    two = torch.tensor([0, 2], dtype=torch.int32)  # the first two tokens of a sequence: no window effect
    assert torch.allclose(windowed[4:6], segment_attention(q[4:6], k[4:6], v[4:6], two, 0.3), atol=1e-12)
    assert not torch.allclose(windowed[4:9], out[4:9])  # further in, the window cuts keys off


def test_varlen_keywords_follow_the_installed_signature():
    assert _varlen_kwargs({"is_causal": 1, "scale": 1}, 0.1, 64) == ({"is_causal": True, "scale": 0.1}, 1.0)
    kwargs, factor = _varlen_kwargs({"window_size": 1}, 0.1, 64)
    assert kwargs == {"window_size": (-1, 0)} and factor == pytest.approx(0.8)  # q pre-scaled: 0.1 x 8


def test_thd_rope_restarts_positions_per_sequence():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 8, generator=g)
    freqs = torch.randn(5, 1, 1, 8, generator=g)  # [max_len, 1, 1, D]
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    got = fused_apply_rotary_pos_emb_thd(t, cu, freqs)
    want = torch.cat(
        [rope_reference(t[:3, None], freqs[:3])[:, 0], rope_reference(t[3:, None], freqs[:4])[:, 0]]
    )
    assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        fused_apply_rotary_pos_emb_thd(t, cu, freqs, cp_size=2)


def test_packed_groups_keep_lm_head_rows_within_the_padded_bound():
    lengths, responses = [10, 7, 7, 6, 5, 5, 5], [4, 2, 4, 4, 1, 3, 2]
    groups = packed_groups(lengths, 33, responses, max_scored=9)  # the head scores response tokens only
    assert groups == [[0, 1], [2, 3, 4], [5, 6]]
    assert all(sum(responses[i] for i in g) <= 9 for g in groups)
    assert packed_groups(lengths, 33, responses, max_scored=12) == [[0, 1, 2], [3, 4, 5, 6]]


def test_trim_cuts_the_response_frame_to_the_longest_response():
    batch = _batch([3, 1], [2, 3], r=6)
    batch.advantages = torch.ones(2, 6)
    (mb,), _ = split_packed(batch, max_tokens=100)
    assert mb.responses.shape == (2, 3) and mb.advantages.shape == (2, 3) and mb.score_pos.shape == (2, 3)
    assert batch.responses.shape == (2, 6)  # the batch itself keeps its frame
