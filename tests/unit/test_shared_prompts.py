"""Shared-prompt micro-batches on CPU (``actor.share_prompts``): the packed row holds each prompt once, the
scoring positions and row positions map into it, the micro-batch split keeps groups together within the
token budget, and shared attention equals every row's own causal attention over prompt + response."""

import torch
import torch.nn.functional as F

from megatron_rl.models.packed_attention import segment_attention, shared_attention
from megatron_rl.rollout.batch import RolloutBatch
from megatron_rl.rollout.packing import pad_layout, token_counts, unpack
from megatron_rl.rollout.shared_prompts import shared_groups, shared_layout, shared_seq_tokens, split_shared

PROMPTS = ([5, 6, 7], [8, 9])  # two groups' prompt tokens
GROUPS = (0, 0, 0, 1, 1)  # rows 0-2 share prompt 0, rows 3-4 prompt 1
RESPONSES = ([11, 12], [13, 14, 15, 16], [17], [18, 19, 20], [21, 22])


def _batch(r: int = 4) -> RolloutBatch:
    rows = [PROMPTS[g] + resp for g, resp in zip(GROUPS, RESPONSES)]
    b, t = len(rows), max(map(len, rows)) + 1  # one column of padding
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    p = torch.tensor([len(PROMPTS[g]) for g in GROUPS])
    n = torch.tensor([len(x) for x in RESPONSES])
    j = torch.arange(r)
    score_pos = (p[:, None] - 1 + j).clamp(max=t - 1)
    return RolloutBatch(
        input_ids=ids, responses=ids.gather(1, (score_pos + 1).clamp(max=t - 1)),
        response_mask=(j < n[:, None]).float(), score_pos=score_pos, prompt_lens=p, response_lens=n,
        group_index=torch.tensor(GROUPS), rollout_log_probs=torch.zeros(b, r), finish_reasons=["stop"] * b,
        rows=[None] * b,
    )  # fmt: skip


def test_the_row_holds_each_prompt_once_and_every_position_maps_into_it():
    batch = _batch()
    lay = shared_layout(batch.input_ids, batch.prompt_lens, batch.response_lens, batch.score_pos)
    # prompt 0, its three responses, prompt 1, its two: 3 + (2 + 4 + 1) + 2 + (3 + 2)
    assert lay.total == 17 and lay.shared and lay.real == 17 == int(lay.row_pos.max()) + 1
    assert lay.input_ids[0].tolist() == [5, 6, 7, 11, 12, 13, 14, 15, 16, 17, 8, 9, 18, 19, 20, 21, 22]
    assert lay.positions[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 3, 0, 1, 2, 3, 4, 2, 3]
    assert lay.cu_seqlens.tolist() == [0, 3, 5, 9, 10, 12, 15, 17]
    # a response segment's keys: its prompt, then itself
    segs = [lay.kv_index[a:b].tolist() for a, b in zip(lay.cu_seqlens_k[:-1], lay.cu_seqlens_k[1:])]
    assert segs[1] == [0, 1, 2, 3, 4] and segs[3] == [0, 1, 2, 9] and segs[5] == [10, 11, 12, 13, 14]
    assert lay.max_seqlen == 4 and lay.max_seqlen_k == 7  # prompt 3 + response 4
    for b in range(len(batch)):  # every real position of row b holds the row's token
        n = int(batch.prompt_lens[b] + batch.response_lens[b])
        assert torch.equal(lay.input_ids[0][lay.row_pos[b, :n]], batch.input_ids[b, :n])
        real = batch.response_mask[b].bool()  # scoring positions: the prompt's last for token 0
        assert torch.equal(
            lay.input_ids[0][lay.score_pos[b][real]], batch.input_ids[b][batch.score_pos[b][real]]
        )
    assert lay.score_pos[:3, 0].tolist() == [2, 2, 2]  # one prompt copy scores the group's first tokens
    rows = unpack(torch.arange(17.0)[None, :, None], lay, batch.seq_len)[..., 0]  # [B, T]
    assert rows[3, :5].tolist() == [10, 11, 12, 13, 14]
    padded = pad_layout(lay, 4)  # sequence parallelism: a padding segment attending to itself
    assert padded.total == 20 and padded.kv_index[-3:].tolist() == [17, 18, 19]
    assert padded.cu_seqlens_k[-1] == padded.kv_index.numel() and padded.real == 17


def test_shared_attention_equals_each_rows_own_causal_attention():
    batch = _batch()
    lay = shared_layout(batch.input_ids, batch.prompt_lens, batch.response_lens, batch.score_pos)
    g = torch.Generator().manual_seed(0)
    # per-token q/k/v as functions of (token, position), so equal tokens at equal positions agree
    table = {h: torch.randn(32, 8, h, 8, generator=g, dtype=torch.float64) for h in (4, 2)}

    def qkv(ids, pos):
        return table[4][ids, pos], table[2][ids, pos], table[2][ids, pos] * 0.5 + 1.0  # q [.., 4, 8]; k, v

    q, k, v = qkv(lay.input_ids[0], lay.positions[0])  # [S, H, D], [S, G, D]
    out = shared_attention(q, k, v, lay.cu_seqlens, lay.kv_index, lay.cu_seqlens_k, lay.max_seqlen,
                           lay.max_seqlen_k, 0.3, None)  # fmt: skip
    for b in range(len(batch)):
        n = int(batch.prompt_lens[b] + batch.response_lens[b])
        qr, kr, vr = qkv(batch.input_ids[b, :n], torch.arange(n))
        alone = F.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (qr, kr, vr)), is_causal=True, enable_gqa=True, scale=0.3
        )[0].transpose(0, 1)  # [n, H, D]
        assert torch.allclose(out[lay.row_pos[b, :n]], alone, atol=1e-12), b
    windowed = segment_attention(
        q, k, v, lay.cu_seqlens, 0.3, window=1, kv_index=lay.kv_index, cu_k=lay.cu_seqlens_k
    )
    assert torch.allclose(windowed[:2], out[:2], atol=1e-12) and not torch.allclose(windowed[5:9], out[5:9])


def test_the_split_keeps_groups_together_within_the_budget():
    groups, prompts, responses = [0, 0, 0, 1, 1, 2], [3, 3, 3, 2, 2, 6], [2, 4, 1, 3, 2, 5]
    # group costs: 0 -> 3 + 7 = 10, 1 -> 2 + 5 = 7, 2 -> 6 + 5 = 11 (largest first)
    assert shared_groups(groups, prompts, responses, 18, 100) == [[5, 3, 4], [0, 1, 2]]
    # a budget smaller than group 0: it is split over micro-batches, each with its prompt again
    split = shared_groups(groups, prompts, responses, 8, 100)
    assert split == [[5], [0], [1, 2], [3, 4]]
    for mb in split[1:]:  # [5] alone is over the budget: a single sequence cannot be split
        seen, cost = set(), 0
        for i in mb:
            cost += responses[i] + (0 if groups[i] in seen else prompts[i])
            seen.add(groups[i])
        assert cost <= 8
    # LM-head rows: a micro-batch's response tokens (the head scores those only)
    assert shared_groups(groups, prompts, responses, 100, 8) == [[5], [0, 1, 2], [3, 4]]
    assert shared_groups(groups, prompts, responses, 100, 6) == [[5], [0, 1], [2, 3, 4]]  # group 0 (7) split


def test_split_shared_counts_prompts_once():
    batch = _batch()
    (mb,), order = split_shared(batch, max_tokens=100)
    assert sorted(order) == list(range(5)) and mb.packed.shared
    real, run, rows = token_counts([mb])
    assert (real, run) == (17, 17) and rows == int((batch.prompt_lens + batch.response_lens).sum()) == 25


def _groups_batch(groups: int, n: int, p: int, r: int) -> RolloutBatch:
    """``groups`` prompts of ``p`` tokens with ``n`` responses of ``r`` tokens each (fixed lengths)."""
    b, t = groups * n, p + r
    ids = torch.arange(b * t).reshape(b, t) % 50 + 1
    for g in range(groups):  # a group's rows share their prompt tokens
        ids[g * n : (g + 1) * n, :p] = ids[g * n, :p]
    j = torch.arange(r)
    score_pos = (p - 1 + j).expand(b, r)
    return RolloutBatch(
        input_ids=ids, responses=ids[:, p:], response_mask=torch.ones(b, r), score_pos=score_pos,
        prompt_lens=torch.full((b,), p), response_lens=torch.full((b,), r),
        group_index=torch.arange(b) // n, rollout_log_probs=torch.zeros(b, r), finish_reasons=["length"] * b,
        rows=[None] * b,
    )  # fmt: skip


def test_shared_micro_batches_hold_the_sequences_the_memory_model_counts():
    """The split's LM-head bound is the memory model's: as many sequences as the budget holds at
    r + p / n tokens each (``shared_seq_tokens``), so a budget for 10 shared sequences holds a whole group
    of 8 (the unshared bound, 340 // 48 = 7 sequences of full length, split every group in two)."""
    p, r, n = 16, 32, 8
    per = shared_seq_tokens(p, r, n)
    assert per == r + p // n == 34
    batch = _groups_batch(4, n, p, r)
    mbs, order = split_shared(batch, 10 * per)
    assert sorted(order) == list(range(32)) and [len(mb) for mb in mbs] == [8, 8, 8, 8]
    for mb in mbs:
        _, run, _ = token_counts([mb])
        assert run == p + n * r <= 10 * per
    mbs, _ = split_shared(batch, 20 * per)  # two groups each: 2 x 272 tokens <= 680
    assert [len(mb) for mb in mbs] == [16, 16]


def test_ranges_concatenates_aranges_with_empty_ones():
    from megatron_rl.rollout.packing import ranges

    starts, lens = [5, 0, 9, 2, 7], [3, 0, 1, 4, 0]
    want = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    got = ranges(starts, lens)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert ranges([3], [0]).numel() == 0
