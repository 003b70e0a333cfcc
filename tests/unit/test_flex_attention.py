"""FlexAttention over a packed row (``models.packed_attention.flex_row_attention``) on CPU: the block mask
built from the row's segment tables equals torch's ``create_block_mask`` of the same mask (partial and full
blocks), and the attention equals the per-segment SDPA reference on shared-prompt rows, plain packed rows
and rows with a padding segment. FlexAttention has no CPU backward: its gradients are checked on the GPU
by the start-up trial (``flex_available``) and ``benchmarks/bench_update_attention.py``."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from megatron_rl.models import packed_attention as pa
from megatron_rl.rollout.packing import pack_layout, pad_layout
from megatron_rl.rollout.shared_prompts import shared_layout


def _shared(prompts: list[int], responses: list[list[int]]):
    """A shared-prompt layout: group g has a prompt of prompts[g] tokens and responses of the given lengths."""
    rows = [(g, p, r) for g, (p, rs) in enumerate(zip(prompts, responses)) for r in rs]
    t = max(p + r for _, p, r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    for i, (g, p, r) in enumerate(rows):
        ids[i, :p] = 1 + g
        ids[i, p : p + r] = 50
    p_lens = torch.tensor([p for _, p, _ in rows])
    r_lens = torch.tensor([r for _, _, r in rows])
    return shared_layout(ids, p_lens, r_lens, torch.zeros(len(rows), max(r_lens), dtype=torch.long))


def _plain(lengths: list[int]):
    t = max(lengths)
    ids = torch.ones(len(lengths), t, dtype=torch.long)
    return pack_layout(ids, torch.tensor(lengths), torch.zeros(len(lengths), 1, dtype=torch.long))


LAYOUTS = {
    "shared": lambda: _shared([24, 7], [[5, 40, 17], [33, 9, 26, 1]]),
    "shared_long": lambda: _shared([130, 3], [[200, 1, 128], [129, 300]]),
    "shared_padded": lambda: pad_layout(_shared([11, 6], [[4, 19], [8, 2, 30]]), 32),
    "plain": lambda: _plain([17, 3, 64, 129, 1]),
    "plain_padded": lambda: pad_layout(_plain([40, 7, 22]), 16),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("block", [16, 128])
def test_block_mask_from_the_segment_tables_equals_create_block_mask(name, block):
    lay = LAYOUTS[name]()
    p, s = lay.seq_params(), lay.total
    ours = pa.flex_block_mask(p, s, block)
    ref = create_block_mask(pa.flex_mask_mod(pa.flex_tables(p, s)), None, None, s, s, device="cpu",
                            BLOCK_SIZE=block)  # fmt: skip
    assert torch.equal(ours.to_dense(), ref.to_dense())  # every block that holds an allowed cell
    full = ref.full_kv_num_blocks
    assert full is not None and torch.equal(ours.full_kv_num_blocks, full)  # and which of them are full
    nb = ours.full_kv_num_blocks[0, 0]
    for i in range(nb.numel()):
        n = int(nb[i])
        assert sorted(ours.full_kv_indices[0, 0, i, :n].tolist()) == sorted(
            ref.full_kv_indices[0, 0, i, :n].tolist()
        )
    assert int(ours.kv_num_blocks.sum()) > 0


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_flex_row_attention_equals_the_per_segment_reference(name):
    lay = LAYOUTS[name]()
    p, s = lay.seq_params(), lay.total
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, h, 16, generator=g) for h in (4, 2, 2))
    ref = pa.segment_attention(q, k, v, p.segments_q, 0.3, kv_index=p.kv_index, cu_k=p.segments_k)
    for block in (16, 128):
        out = pa.flex_row_attention(q, k, v, p, 0.3, block_mask=pa.flex_block_mask(p, s, block))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the mask matters: a row whose segments were ignored (one causal sequence) differs
    whole = pa.SegmentSeqParams(qkv_format="thd", segments_q=torch.tensor([0, s], dtype=torch.int32), max_q=s)
    assert not torch.allclose(pa.flex_row_attention(q, k, v, whole, 0.3), ref, atol=1e-3)


def test_tables_read_a_responses_prompt_where_it_sits():
    lay = _shared([3, 2], [[2, 1], [3]])  # row: P0 (0-2), R (3-4), R (5), P1 (6-7), R (8-10)
    seg, start, ext_start, ext_len = pa.flex_tables(lay.seq_params(), lay.total)
    assert seg.tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 4, 4, 4]
    assert start.tolist() == [0, 0, 0, 3, 3, 5, 6, 6, 8, 8, 8]
    assert ext_len.tolist() == [0, 0, 0, 3, 3, 3, 0, 0, 2, 2, 2]
    assert ext_start[3:6].tolist() == [0, 0, 0] and ext_start[8:].tolist() == [6, 6, 6]
