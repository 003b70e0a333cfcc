"""SwiGLU as one fused kernel per direction, as the activation module of our MLP ModuleSpec.

megatron-core's unfused GLU runs chunk, SiLU and a product forward (keeping the SiLU output for backward)
and five elementwise kernels plus a ``cat`` backward. Here forward and backward are each one compiled
kernel (fp32 inside, one rounding), only the fc1 output is kept, and the row count is the only dynamic
size (see ``compile_rows_dynamic``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return _kernels(y.device)[0](y)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return _kernels(y.device)[1](grad.contiguous(), y)


def swiglu(y: Tensor) -> Tensor:
    """y [..., 2F] -> [..., F], differentiable; fused where ``kernels.compile`` allows."""
    lead = y.shape[:-1]
    return _SwiGLU.apply(y.reshape(-1, y.shape[-1])).view(*lead, -1)


class SwiGLU(torch.nn.Module):
    """The MLP activation module (``MLPSubmodules.activation_func``): megatron-core's MLP hands it the
    whole fc1 output when ``config.use_te_activation_func`` is set (its name; no TE involved)."""

    def __init__(self, config=None):
        super().__init__()

    def forward(self, y: Tensor) -> Tensor:
        return swiglu(y)
