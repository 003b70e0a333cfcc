"""SwiGLU as one fused kernel per direction, as the activation module of our MLP ModuleSpec.

megatron-core's unfused GLU runs chunk, SiLU and a product forward (keeping the SiLU output for backward)
and five elementwise kernels plus a ``cat`` backward. Here forward and backward are each one compiled
kernel (fp32 inside, one rounding), only the fc1 output is kept, and the row count is the only dynamic
size (see ``compile_rows_dynamic``).

A hand-written Triton backward (``triton_backward``) can replace the compiled one outside the exact mode:
measured on an H200 at the 0.5B shape (fc1 output [34816, 9728] bf16), inductor's compiled backward took
624 us per call in session 18's profile, 56% of the HBM rate for the bytes it must move (read y and the gradient, write dy: 5 N F
x 2 bytes), likely because its ``cat`` makes each output element load its inputs again. The Triton kernel
loads gate, up and the gradient of a column once and stores both halves of dy from them. The forward
(230 us) is near the HBM rate already and stays compiled. Measured on an H200 (session 19,
``bench_update_kernels.py``): 572 -> 397 us per call at 0.5B (89% of the HBM rate), 1261 -> 893 us at 3B's
F = 11008, the same bits as the compiled backward (0 elements differ). On by default on CUDA;
``MEGATRON_RL_TRITON_SWIGLU=0`` turns it off; a trial per device and dtype guards it (a failure or a
disagreement with ``swiglu_backward`` warns once and the compiled backward serves). Tests run it on CPU
under Triton's interpreter (``RUN_ON_CPU``).

The exact mode (``rollout.exact_logprobs``) has its own forward, ``exact_forward``: the one function the
engine's decoder and the trainer's exact MLP both call, so that the two give the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_rl.kernels import decode_fused
from megatron_rl.kernels.compile import compile_enabled, compile_rows_dynamic, env_switch, trial_once

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: the compiled or eager backward serves
    HAVE_TRITON = False


def swiglu_forward(y: Tensor) -> Tensor:
    """y [N, 2F] (gate half, then up half) -> silu(gate) * up [N, F]."""
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)


def swiglu_backward(grad: Tensor, y: Tensor) -> Tensor:
    """grad [N, F], y [N, 2F] -> d/dy [N, 2F]."""
    gate, up = y.float().chunk(2, dim=-1)
    g = grad.float()
    sig = torch.sigmoid(gate)
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    return torch.cat((d_gate, g * gate * sig), dim=-1).to(y.dtype)


_COMPILED = compile_rows_dynamic(swiglu_forward), compile_rows_dynamic(swiglu_backward)


def _kernels(device: torch.device):
    return _COMPILED if compile_enabled(device) else (swiglu_forward, swiglu_backward)


if HAVE_TRITON:
    # rows not specialised on (its divisibility by 16 would compile a second kernel for the micro-batches
    # of the other kind, ~1-2 s each at start-up; the trial's 19 rows then share the real calls' kernel)
    @triton.jit(do_not_specialize=["rows"])
    def _backward_kernel(y_ptr, g_ptr, dy_ptr, rows, ffn, stride_y, stride_g, stride_dy,
                         block_rows: tl.constexpr, block_cols: tl.constexpr):  # fmt: skip
        # one grid axis, column blocks fastest: neighbouring programs read neighbouring columns of the same
        # rows, and the row blocks are not bound by the 65,535 programs of a second grid axis
        pid = tl.program_id(0)
        col_blocks = tl.cdiv(ffn, block_cols)
        r = (pid // col_blocks) * block_rows + tl.arange(0, block_rows)
        j = (pid % col_blocks) * block_cols + tl.arange(0, block_cols)
        live = (r < rows)[:, None] & (j < ffn)[None, :]
        rr = r.to(tl.int64)[:, None]  # N x 2F passes 2^31 (at 3B's 2F = 22,016 from 97,542 rows on)
        y_at = y_ptr + rr * stride_y + j[None, :]
        gate = tl.load(y_at, mask=live, other=0.0).to(tl.float32)
        up = tl.load(y_at + ffn, mask=live, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rr * stride_g + j[None, :], mask=live, other=0.0).to(tl.float32)
        # swiglu_backward's formula, operation for operation (tl.sigmoid is what inductor emits for it)
        sig = tl.sigmoid(gate)
        d_gate = g * up * sig * (1 + gate * (1 - sig))
        d_up = g * gate * sig
        dy_at = dy_ptr + rr * stride_dy + j[None, :]
        tl.store(dy_at, d_gate.to(dy_ptr.dtype.element_ty), mask=live)
        tl.store(dy_at + ffn, d_up.to(dy_ptr.dtype.element_ty), mask=live)


# Tests run the kernel on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton is
# first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False
ON_CUDA = env_switch("MEGATRON_RL_TRITON_SWIGLU", True)
PROBE = "the Triton SwiGLU backward"
# the trial's tolerance against the eager swiglu_backward: about one ulp of the output dtype (GPU exp and
# sigmoid need not round as torch's), an atol for outputs near 0 where 1 + gate (1 - sig) cancels
_TRIAL_RTOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}


def usable(y: Tensor) -> bool:
    """Whether the SwiGLU backward for y [N, 2F] runs ``triton_backward``: Triton importable, on CUDA with
    ``ON_CUDA`` (or CPU with ``RUN_ON_CPU``), bf16/fp16/fp32, and a trial on a small input of that device
    and dtype ran and agreed with ``swiglu_backward`` (else it warns once; the compiled backward serves)."""
    dev = y.device.type
    return (
        HAVE_TRITON
        and ((ON_CUDA and dev == "cuda") or (RUN_ON_CPU and dev == "cpu"))
        and y.dtype in _TRIAL_RTOL
        and y.dim() == 2
        and y.shape[-1] % 2 == 0
        and trial_once(
            f"{PROBE} ({dev}, {y.dtype})",
            lambda: _trial(y.device, y.dtype),
            "The Triton SwiGLU backward failed its trial; the compiled backward serves (slower, the same "
            "formula).",
        )
    )


def _trial(device, dtype) -> None:
    """The kernel once against the eager ``swiglu_backward``: rows and F (320, divisible by 16 as real FFN
    sizes are; Triton specialises on it) not multiples of the blocks, a row stride wider than 2F."""
    g = torch.Generator().manual_seed(0)  # not the device's generator: the trial runs mid-training
    y = (3 * torch.randn(19, 704, generator=g)).to(device, dtype)[:, :640]
    grad = torch.randn(19, 320, generator=g).to(device, dtype)
    got, want = triton_backward(grad, y).float(), swiglu_backward(grad, y).float()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a fault in the launch surfaces here, not mid-update
    bad = (got - want).abs() > 1e-4 + _TRIAL_RTOL[dtype] * want.abs()
    if bool(bad.any()):
        raise RuntimeError(
            f"it disagrees with swiglu_backward at {int(bad.sum())} of {bad.numel()} elements "
            f"(largest gap {float((got - want).abs().max()):.3g})"
        )


def triton_backward(
    grad: Tensor, y: Tensor, block_rows: int = 8, block_cols: int = 256, num_warps: int = 4
) -> Tensor:
    """grad [N, F], y [N, 2F] (any row strides) -> dy [N, 2F] contiguous in y's dtype: ``swiglu_backward``'s
    fp32 formula, one rounding, each input element loaded once. ``block_cols`` 256 divides the FFN sizes of
    Qwen2.5 0.5B (4,864) and 3B (11,008), so no column block is partly masked there."""
    rows, two_f = y.shape
    ffn = two_f // 2
    y = y if y.stride(-1) == 1 else y.contiguous()
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    dy = torch.empty(rows, two_f, dtype=y.dtype, device=y.device)
    if rows and ffn:
        grid = (triton.cdiv(rows, block_rows) * triton.cdiv(ffn, block_cols),)
        _backward_kernel[grid](y, grad, dy, rows, ffn, y.stride(0), grad.stride(0), dy.stride(0),
                               block_rows=block_rows, block_cols=block_cols, num_warps=num_warps)  # fmt: skip
    return dy


def exact_forward(y: Tensor) -> Tensor:
    """The exact mode's SwiGLU, y [N, 2F] -> [N, F]: each element alone, fp32 inside, one rounding, so no
    row count or position can change it. ``decode_fused.swiglu``'s Triton kernel where it serves y and
    passed its trial (a choice made per device, dtype and width: the same for the decode step's rows and a
    training micro-batch's), else ``swiglu_forward`` eagerly (not compiled: Inductor's SiLU need not round as
    the kernel's, and the two sides must not differ in that choice either)."""
    if decode_fused.usable("swiglu", y):
        return decode_fused.swiglu(y)
    return swiglu_forward(y)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, exact):
        ctx.save_for_backward(y)
        ctx.exact = exact
        return exact_forward(y) if exact else _kernels(y.device)[0](y)

    @staticmethod
    def backward(ctx, grad):  # fp32 inside, one rounding, for both modes (a gradient carries no log-prob)
        (y,) = ctx.saved_tensors
        if not ctx.exact and usable(y):  # outside the exact mode only: its path stays as it was measured
            return triton_backward(grad, y), None
        return _kernels(y.device)[1](grad.contiguous(), y), None


def swiglu(y: Tensor, exact: bool = False) -> Tensor:
    """y [..., 2F] -> [..., F], differentiable; fused where ``kernels.compile`` allows; ``exact``: the
    forward is ``exact_forward``."""
    lead = y.shape[:-1]
    # F spelled out, not -1: a view of zero rows cannot infer it
    return _SwiGLU.apply(y.reshape(-1, y.shape[-1]), exact).view(*lead, y.shape[-1] // 2)


class SwiGLU(torch.nn.Module):
    """The MLP activation module (``MLPSubmodules.activation_func``): megatron-core's MLP hands it the
    whole fc1 output when ``config.use_te_activation_func`` is set (its name; no TE involved)."""

    exact = False

    def __init__(self, config=None):
        super().__init__()

    def forward(self, y: Tensor) -> Tensor:
        return swiglu(y, self.exact)


class ExactSwiGLU(SwiGLU):
    """The exact model's activation module (``models.exact_layers.block_spec``): ``exact_forward``, the
    engine's exact decode step's SwiGLU, with the fused backward."""

    exact = True
