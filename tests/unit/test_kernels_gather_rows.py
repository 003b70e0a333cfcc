"""kernels/gather_rows.py (Triton's interpreter on CPU): the shared-prompt K/V gather's backward sums each
source row's copies in fp32 in gather order (the bits of that sequential sum, rounded once), equals autograd's
index_select backward within that rounding, takes megatron-core's strided K/V views, gets its copy lists from
every packed layout (padding segment included), and a kernel that is off fails its trial and falls back."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")

from megatron_rl.kernels import compile as kc  # noqa: E402
from megatron_rl.kernels import gather_rows as gr  # noqa: E402
from megatron_rl.rollout.packing import pad_layout  # noqa: E402
from megatron_rl.rollout.shared_prompts import shared_layout  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(gr, "RUN_ON_CPU", True)
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})


def _sequential(grad: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """Row s: the fp32 sum of grad at the positions where index == s, in increasing position, rounded once."""
    out = torch.zeros(rows, *grad.shape[1:], dtype=torch.float32)
    for pos, s in enumerate(index.tolist()):
        out[s] += grad[pos].float()
    return out.to(grad.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "groups,dim", [(2, 8), (3, 4)]
)  # 3 x 4: a (group, dim) block that is not a power of two
def test_segment_sum_is_the_sequential_fp32_sum_in_gather_order(dtype, groups, dim):
    torch.manual_seed(0)
    rows = 150
    counts = torch.randint(0, 10, (rows,))
    counts[::7] = 0  # rows no segment reads: zero gradient
    index = torch.repeat_interleave(torch.arange(rows), counts)
    index = index[torch.randperm(index.numel())]
    both = (3 * torch.randn(index.numel(), groups, 2, dim)).to(dtype)
    gk, gv = both[:, :, 0], both[:, :, 1]  # strided in G, unit stride in D
    order, ptr = gr.inverse(index, rows)
    assert torch.equal(index[order], torch.repeat_interleave(torch.arange(rows), counts))
    assert ptr.tolist() == [0] + torch.cumsum(counts, 0).tolist()
    dk, dv = gr.segment_sum(gk, gv, order, ptr)  # one program (tile_for: 256 rows at these widths)
    assert torch.equal(dk, _sequential(gk, index, rows))
    assert torch.equal(dv, _sequential(gv, index, rows))
    assert gr.tile_for(groups, dim) >= rows
    for tile in (8, 64):  # 19 and 3 programs, the last ragged
        assert all(torch.equal(a, b) for a, b in zip(gr.segment_sum(gk, gv, order, ptr, tile=tile), (dk, dv)))
    assert not dk[::7].any()
    want = torch.zeros(rows, groups, dim, dtype=torch.float64).index_add_(0, index, gk.double())
    torch.testing.assert_close(dk.double(), want, rtol=4e-3 if dtype == torch.bfloat16 else 1e-6, atol=1e-5)


def test_gather_kv_gradients_equal_autograd_through_index_select():
    torch.manual_seed(1)
    s, groups, dim = 40, 2, 8
    qkv = torch.randn(s, groups, 4, dim, requires_grad=True)  # megatron-core's [S, G, rep + 2, D] split
    index = torch.cat(
        [torch.arange(10), torch.arange(10), torch.arange(10, 25), torch.arange(10), torch.arange(25, 40)]
    )
    grads = torch.randn(2, index.numel(), groups, dim)
    got_k, got_v = gr.gather_kv(qkv[:, :, 2], qkv[:, :, 3], index, *gr.inverse(index, s))
    assert got_k.grad_fn is not None and "GatherKV" in type(got_k.grad_fn).__name__  # the kernel's backward
    (got_k * grads[0] + got_v * grads[1]).sum().backward()
    got = qkv.grad.clone()
    qkv.grad = None
    want_k, want_v = qkv[:, :, 2].index_select(0, index), qkv[:, :, 3].index_select(0, index)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # the forward is index_select
    (want_k * grads[0] + want_v * grads[1]).sum().backward()
    torch.testing.assert_close(got, qkv.grad, rtol=1e-6, atol=1e-6)
    assert not got[:, :, :2].any()  # q's rows get nothing from the gather


def test_gather_kv_without_copy_lists_or_gradients_is_index_select():
    k, v = torch.randn(6, 1, 4, requires_grad=True), torch.randn(6, 1, 4, requires_grad=True)
    index = torch.tensor([0, 1, 0, 2, 3, 4, 5])
    out = gr.gather_kv(k, v, index)  # no order / ptr: autograd's backward
    assert "IndexSelect" in type(out[0].grad_fn).__name__
    with torch.no_grad():
        out = gr.gather_kv(k, v, index, *gr.inverse(index, 6))
    assert out[0].grad_fn is None and torch.equal(out[0], k.detach()[index])


def test_every_shared_layout_lists_the_copies_of_its_key_rows():
    """shared_layout's seq_params carries inverse(kv_index): each packed row's copies, padding segment included."""
    prompt = [5, 6, 7]
    rows = [prompt + [1, 2, 0], prompt + [3, 0, 0], [9, 8] + [4, 4, 4, 0]]
    ids = torch.tensor(rows)
    lay = shared_layout(
        ids, torch.tensor([3, 3, 2]), torch.tensor([2, 1, 3]), torch.zeros(3, 3, dtype=torch.long)
    )
    for layout in (lay, pad_layout(lay, 8)):
        p = layout.seq_params()
        order, ptr = p.kv_order, p.kv_ptr
        assert ptr.numel() == layout.total + 1 and int(ptr[-1]) == p.kv_index.numel()
        for row in range(layout.total):
            where = order[ptr[row] : ptr[row + 1]]
            assert where.tolist() == (p.kv_index == row).nonzero().flatten().tolist()
    assert (
        lay.seq_params().kv_ptr.diff()[:3] == 3
    ).all()  # the shared prompt: its own segment and two responses'


def test_a_kernel_off_by_a_percent_fails_its_trial_and_index_add_serves(monkeypatch):
    real = gr.segment_sum

    def off(gk, gv, order, ptr):
        dk, dv = real(gk, gv, order, ptr)
        return dk * 1.01, dv

    monkeypatch.setattr(gr, "segment_sum", off)
    k, v = torch.randn(5, 2, 8, requires_grad=True), torch.randn(5, 2, 8, requires_grad=True)
    index = torch.tensor([0, 1, 2, 0, 3, 4, 0])
    with pytest.warns(UserWarning, match="gather backward failed its trial.*gap to a float64 sum"):
        out = gr.gather_kv(k, v, index, *gr.inverse(index, 5))
    assert "IndexSelect" in type(out[0].grad_fn).__name__


def test_shared_attention_sums_the_prompt_keys_gradients_with_the_kernel(monkeypatch):
    """The varlen path of models.packed_attention.shared_attention (a per-segment stand-in for the GPU kernel)
    with a layout's copy lists: the gather's backward is the kernel's, and q / k / v gradients equal the
    per-segment SDPA reference's."""
    import megatron_rl.models.packed_attention as pa

    def varlen(q, k, v, cu, max_q, scale, cu_k=None, max_k=None):  # k, v: the gathered key segments
        return pa.segment_attention(q, k, v, cu, scale, kv_index=torch.arange(k.shape[0]), cu_k=cu_k)

    calls = []
    real = gr.segment_sum
    monkeypatch.setattr(pa, "varlen_attention", varlen)
    monkeypatch.setattr(gr, "segment_sum", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(12, h, 8, generator=g, requires_grad=True) for h in (6, 2, 2))
    idx = torch.tensor(
        [*range(5), *range(5), 5, 6, 7, *range(5), 8, 9, 10, 11]
    )  # a prompt of 5, responses of 3, 4
    cq, ck = torch.tensor([0, 5, 8, 12]), torch.tensor([0, 5, 13, 22])
    order, ptr = gr.inverse(idx, 12)
    got = pa.shared_attention(q, k, v, cq, idx, ck, 5, 9, 0.3, None, varlen=True, kv_order=order, kv_ptr=ptr)
    want = pa.segment_attention(q, k, v, cq, 0.3, kv_index=idx, cu_k=ck)
    w = torch.randn(got.shape, generator=g)
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    assert len(calls) == 2  # the trial's call and the backward's
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_copy_lists_of_another_layout_are_refused_by_name():
    k, v = torch.randn(5, 2, 8, requires_grad=True), torch.randn(5, 2, 8, requires_grad=True)
    index = torch.tensor([0, 1, 2, 0, 3, 4, 0])
    with pytest.raises(ValueError, match=r"copy lists for 6 rows, keys have 5: inverse\(index, rows\)"):
        gr.gather_kv(k, v, index, *gr.inverse(index, 6))
