"""SwiGLU as one fused kernel per direction, as the activation module of our MLP ModuleSpec.

megatron-core's unfused GLU runs chunk, SiLU and a product forward (keeping the SiLU output for backward)
and five elementwise kernels plus a ``cat`` backward. Here forward and backward are each one compiled
kernel (fp32 inside, one rounding), only the fc1 output is kept, and the row count is the only dynamic
size (see ``compile_rows_dynamic``).

The exact mode (``rollout.exact_logprobs``) has its own forward, ``exact_forward``: the one function the
engine's decoder and the trainer's exact MLP both call, so that the two give the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_rl.kernels import decode_fused
from megatron_rl.kernels.compile import compile_enabled, compile_rows_dynamic


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
        return exact_forward(y) if exact else _kernels(y.device)[0](y)

    @staticmethod
    def backward(ctx, grad):  # the compiled fp32 backward for both (a gradient carries no log-prob)
        (y,) = ctx.saved_tensors
        return _kernels(y.device)[1](grad.contiguous(), y), None


def swiglu(y: Tensor, exact: bool = False) -> Tensor:
    """y [..., 2F] -> [..., F], differentiable; fused where ``kernels.compile`` allows; ``exact``: the
    forward is ``exact_forward``."""
    lead = y.shape[:-1]
    return _SwiGLU.apply(y.reshape(-1, y.shape[-1]), exact).view(*lead, -1)


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
