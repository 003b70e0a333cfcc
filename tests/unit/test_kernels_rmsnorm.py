"""kernels/rmsnorm.py's Triton backward (Triton's interpreter on CPU) against autograd through torch's
F.rms_norm, through models.spec.RMSNorm: dx and the weight gradient, several rows per program with a ragged
last run, a hidden size that is not a power of two, fp32 and bf16; a failing trial falls back with a warning."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")

from megatron_rl.kernels import compile as kc  # noqa: E402
from megatron_rl.kernels import rmsnorm as kernel  # noqa: E402
from megatron_rl.models.spec import RMSNorm  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backward_equals_autograd_through_torch_rms_norm(dtype, tol):
    torch.manual_seed(0)
    norm = RMSNorm(SimpleNamespace(params_dtype=dtype, sequence_parallel=False), 48, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    ref_w = norm.weight.detach().clone().requires_grad_(True)
    x = (3 * torch.randn(7, 3, 48)).to(dtype).requires_grad_(True)  # 21 rows
    x_ref = x.detach().clone().requires_grad_(True)
    g = torch.randn(7, 3, 48).to(dtype)
    out = norm(x)
    ref = torch.nn.functional.rms_norm(x_ref, (48,), ref_w, 1e-6)
    assert torch.equal(out, ref)  # the forward is torch's
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(norm.weight.grad, ref_w.grad, rtol=tol, atol=tol * 10)
    x2, g2 = x.detach().reshape(21, 48), g.reshape(21, 48)
    # 11 (with tiles of 8 rows: two, the second ragged), 6, 4 and 1 rows per program (the last run shorter);
    # 1/rms recomputed and the forward's (torch's fused op: the trainer's path where this torch has it)
    saved = kernel._forward(x2, norm.weight.detach(), 1e-6)[1]
    assert saved is not None  # torch 2.13's CPU build has the op: the saved path is the one tested
    for programs in (2, 4, 6, 64):
        for tile in (2, 8):
            for rstd in (None, saved):
                dx, dw = kernel.backward(x2, norm.weight.detach(), g2, 1e-6, programs, tile, 4, rstd=rstd)
                torch.testing.assert_close(dx, x_ref.grad.reshape(21, 48), rtol=tol, atol=tol)
                torch.testing.assert_close(dw, ref_w.grad, rtol=tol, atol=tol * 10)


def test_a_backward_that_fails_its_trial_warns_and_torch_serves(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(kernel, "backward", broken)
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    with pytest.warns(UserWarning, match="no kernel for this GPU"):
        out = kernel.rms_norm(x, w, 1e-6)
    out.sum().backward()
    assert x.grad is not None and not kernel.usable(x)


def test_wide_rows_take_small_tiles():
    """Hidden 1100 (block 2048: two rows a tile, the 0.5B/3B kernels' shape class) against autograd."""
    torch.manual_seed(1)
    x, dy = torch.randn(9, 1100), torch.randn(9, 1100)
    w = 0.5 + torch.rand(1100)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    torch.nn.functional.rms_norm(xr, (1100,), wr, 1e-6).backward(dy)
    dx, dw = kernel.backward(x, w, dy, 1e-6, programs=2)  # 5 rows a program: a tile of 2, 2, then 1
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, wr.grad, rtol=1e-5, atol=1e-4)


def test_a_backward_that_disagrees_in_its_trial_warns_and_torch_serves(monkeypatch):
    """The trial compares with autograd at the real width: a kernel with a wrong dx is refused."""
    right = kernel.backward
    monkeypatch.setattr(kernel, "backward", lambda *a, **k: (2 * right(*a, **k)[0], right(*a, **k)[1]))
    x = torch.randn(4, 40, requires_grad=True)
    with pytest.warns(UserWarning, match="largest gap"):
        assert not kernel.usable(x)
