"""kernels/swiglu.py's Triton backward (Triton's interpreter on CPU) against ``swiglu_backward`` and against
eager autograd of ``swiglu_forward``: bf16, fp16 and fp32, row counts and FFN sizes that are not multiples of the
blocks, zero rows, strided rows; the autograd path takes it with the switch on and only outside the exact
mode; a kernel that fails or disagrees in its trial warns once and the other backward serves.

bf16 is compared within one ulp, not bit for bit: the interpreter casts fp32 to bf16 by truncation where
the GPU rounds to nearest even, and numpy's exp is not torch's (on a GPU the kernel and inductor's compiled
backward both run ``tl.sigmoid``: ``bench_update_kernels.py`` reports their largest gap)."""

import warnings

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")

from megatron_rl.kernels import compile as kc  # noqa: E402
from megatron_rl.kernels import swiglu as sw  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(sw, "RUN_ON_CPU", True)
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "0")  # the other path: the eager functions (no C++ compile)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between two tensors of one float dtype (-0 == +0)."""
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    top = (1 << (8 * a.element_size() - 1)) - 1

    def ordered(x):
        i = x.contiguous().view(ints).long()
        return torch.where(i < 0, -(i & top), i)

    return (ordered(a) - ordered(b)).abs()


def _inputs(rows, ffn, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = (3 * torch.randn(rows, 2 * ffn, generator=g)).to(dtype)  # gates across the sigmoid's whole range
    return torch.randn(rows, ffn, generator=g).to(dtype), y


def _assert_matches(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert int(_ulps(got, want).max()) <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "rows,ffn,blocks",
    [(37, 300, (8, 256)), (1, 17, (8, 256)), (21, 200, (4, 64)), (16, 320, (8, 64))],
)  # fmt: skip
def test_backward_equals_swiglu_backward(dtype, rows, ffn, blocks):
    """Rows and F not multiples of the blocks (a ragged last row and column block; several column blocks
    per row block with the smaller blocks), one row, and sizes the blocks divide."""
    grad, y = _inputs(rows, ffn, dtype)
    got = sw.triton_backward(grad, y, block_rows=blocks[0], block_cols=blocks[1])
    _assert_matches(got, sw.swiglu_backward(grad, y))


def test_zero_rows_and_strided_inputs():
    """No rows: an empty dy. Row strides wider than the row (y a slice of a wider fc1 buffer,
    as ``swiglu``'s reshape passes one; grad a column slice) and grad with a non-unit column stride: the
    bits of the contiguous call."""
    for dtype in (torch.bfloat16, torch.float32):
        grad, y = _inputs(0, 40, dtype)
        assert sw.triton_backward(grad, y).shape == (0, 80)
    grad, y = _inputs(13, 48, torch.bfloat16, seed=1)
    wide = torch.zeros(13, 96 + 32, dtype=torch.bfloat16)
    wide[:, :96] = y
    g_wide = torch.zeros(13, 48 + 16, dtype=torch.bfloat16)
    g_wide[:, 16:] = grad
    want = sw.triton_backward(grad, y, block_cols=32)
    assert torch.equal(sw.triton_backward(g_wide[:, 16:], wide[:, :96], block_cols=32), want)
    g_cols = grad.t().contiguous().t()  # column stride 13
    assert torch.equal(sw.triton_backward(g_cols, wide[:, :96], block_cols=32), want)
    _assert_matches(want, sw.swiglu_backward(grad, y))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_autograd_takes_the_kernel_and_matches_eager_autograd(monkeypatch, dtype, tol):
    """``SwiGLU`` with the switch on: the backward is ``triton_backward`` (after its trial, once per call), gradients ==
    eager autograd through ``swiglu_forward``, for [s, b, 2F] input, a strided fc1 slice and zero rows;
    ``ExactSwiGLU`` keeps the compiled (here eager) backward."""
    calls = []
    original = sw.triton_backward
    monkeypatch.setattr(sw, "triton_backward", lambda g, y: calls.append(y.shape) or original(g, y))
    torch.manual_seed(0)
    for lead, wide in (((7, 3), 0), ((11,), 24), ((0, 2), 0)):
        base = (3 * torch.randn(*lead, 2 * 40 + wide)).to(dtype)
        x = base.clone().requires_grad_(True)
        x_ref = base[..., :80].clone().requires_grad_(True)
        g = torch.randn(*lead, 40).to(dtype)
        out = sw.SwiGLU()(x[..., :80])
        ref = sw.swiglu_forward(x_ref.reshape(-1, 80)).view(*lead, 40)
        assert torch.equal(out, ref)  # the forward is unchanged
        out.backward(g)
        ref.backward(g)
        assert calls[-1] == (x_ref.numel() // 80, 80)
        torch.testing.assert_close(x.grad[..., :80], x_ref.grad, rtol=tol, atol=tol / 10)
        assert not x.grad[..., 80:].any()
    assert calls[1:] == [(21, 80), (11, 80), (0, 80)]  # calls[0]: the trial's; then one per backward
    x = (3 * torch.randn(5, 80)).to(dtype).requires_grad_(True)
    sw.ExactSwiGLU()(x).sum().backward()
    assert len(calls) == 4 and x.grad is not None  # the exact mode's path: no Triton backward


@pytest.mark.parametrize("failure", ["raises", "disagrees"])
def test_a_kernel_that_fails_its_trial_warns_once_and_the_other_backward_serves(monkeypatch, failure):
    def broken(grad, y, **kw):
        if failure == "raises":
            raise RuntimeError("no kernel for this GPU")
        return torch.zeros(y.shape, dtype=y.dtype, device=y.device)

    monkeypatch.setattr(sw, "triton_backward", broken)
    torch.manual_seed(0)
    x = torch.randn(6, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    g = torch.randn(6, 32)
    with pytest.warns(UserWarning, match="no kernel for this GPU" if failure == "raises" else "disagrees"):
        sw.SwiGLU()(x).backward(g)
    sw.swiglu_forward(x_ref).backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the failure is remembered, no second trial or warning
        assert not sw.usable(x.detach())
        x.grad = None
        sw.SwiGLU()(x).backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def test_off_where_the_switch_is_off(monkeypatch):
    """``usable`` is False off the devices the switches allow (CPU without ``RUN_ON_CPU``) and for dtypes
    the kernel does not take."""
    monkeypatch.setattr(sw, "RUN_ON_CPU", False)
    assert not sw.usable(torch.randn(4, 64))
    monkeypatch.setattr(sw, "RUN_ON_CPU", True)
    assert sw.usable(torch.randn(4, 64)) and not sw.usable(torch.randn(4, 64, dtype=torch.float64))
