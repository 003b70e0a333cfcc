"""Weight gradients accumulated straight into the fp32 ``main_grad``: megatron-core's
``gradient_accumulation_fusion`` without apex (``optim.gradient_accumulation_fusion``).

Unfused, every linear layer's backward writes a bf16 weight gradient per micro-batch, and a hook (megatron-core's
DDP, or ``optim.local``'s) adds it into the fp32 ``main_grad``: a bf16 write, a bf16 read and an fp32
read-modify-write per weight per micro-batch, one extra kernel each, and the product rounded to bf16 before
it is summed. Fused, the weight-gradient GEMM accumulates into ``main_grad`` itself (fp32 C, beta = 1): the
product is never rounded to bf16 and no separate add runs.

megatron-core's linear layers with ``gradient_accumulation_fusion`` call
``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, main_grad)`` (apex's extension);
without apex that name is unbound in ``megatron.core.tensor_parallel.layers``, and ``install`` binds it to
this module. On CUDA the GEMM is one cuBLAS call with bf16/fp16 operands and fp32 output accumulated in place
(``torch.addmm(..., out_dtype=torch.float32, out=main_grad)``), tried once per device and dtype before it
serves (``cuda_serves``). On CPU (tests) the product is taken in fp32.

``resolve`` picks the layers (trainable bf16/fp16 weights only) and ``enable`` turns the flag on for each
(megatron-core reads ``layer.gradient_accumulation_fusion`` at each forward): their owner (the optimizer) must
give each a ``main_grad`` before the forward of a backward pass, as megatron-core's forward captures it.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import Tensor

HALF = (torch.bfloat16, torch.float16)
_CUDA_TRIAL: dict[tuple, bool] = {}  # (device, dtype) -> addmm with fp32 out accumulated in place is right


def _addmm_into_fp32(main_grad: Tensor, a: Tensor, b: Tensor) -> None:
    torch.addmm(main_grad, a, b, out_dtype=torch.float32, out=main_grad)


def cuda_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's mixed-precision addmm (half operands, fp32 C, in place) runs and accumulates right
    on ``device``: two accumulations into a random fp32 matrix against fp32 products of the same operands."""
    key = (str(device), dtype)
    if key not in _CUDA_TRIAL:
        g = torch.Generator(device="cpu").manual_seed(0)
        # as the backward calls it: dy [M, N] transposed (a view), x [M, K] contiguous
        a = torch.randn(136, 72, generator=g).to(device, dtype).t()
        b = torch.randn(136, 40, generator=g).to(device, dtype)
        c = torch.randn(72, 40, generator=g).to(device)
        want = c + 2 * (a.float() @ b.float())
        try:
            _addmm_into_fp32(c, a, b)
            _addmm_into_fp32(c, a, b)
            ok = bool(torch.allclose(c, want, rtol=1e-4, atol=1e-4))
            err = "" if ok else f"largest difference {float((c - want).abs().max()):.3g}"
        except (RuntimeError, TypeError) as e:  # an op or overload this torch build lacks
            ok, err = False, str(e).splitlines()[0]
        if not ok:
            warnings.warn(
                f"optim.gradient_accumulation_fusion: torch.addmm with out_dtype=float32 into the fp32 grad "
                f"failed its trial on {device} ({err}); weight gradients are added unfused",
                stacklevel=2,
            )
        _CUDA_TRIAL[key] = ok
    return _CUDA_TRIAL[key]


def wgrad_gemm_accum_fp32(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """apex's contract: ``main_grad [N, K] += grad_output [M, N]^T @ total_input [M, K]``, main_grad fp32."""
    a, b = grad_output.t(), total_input
    if main_grad.is_cuda and a.dtype in HALF and b.dtype == a.dtype:
        _addmm_into_fp32(main_grad, a, b)
    else:  # CPU, or fp32 operands: the product in main_grad's dtype
        main_grad.addmm_(a.to(main_grad.dtype), b.to(main_grad.dtype))


def wgrad_gemm_accum_fp16(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """The same into a bf16/fp16 ``main_grad`` (DDP with grad_reduce_in_fp32=false)."""
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def accumulate(weight: Tensor, main_grad: Tensor, total_input: Tensor, grad_output: Tensor) -> Tensor | None:
    """A fused weight gradient for a custom linear (``models.exact_layers``), with megatron-core's contract
    towards its DDP hook: accumulate into ``main_grad``, then return what autograd should receive for the
    weight: None where the owner adds no ``.grad`` (``optim.local``), else a dummy the DDP hook skips (zeros
    for a weight that also gets a real gradient elsewhere, ``zero_out_wgrad``: the tied embedding)."""
    x2 = total_input.reshape(-1, total_input.shape[-1])
    g2 = grad_output.reshape(-1, grad_output.shape[-1])
    if main_grad.dtype == torch.float32:
        wgrad_gemm_accum_fp32(x2, g2, main_grad)
    else:
        wgrad_gemm_accum_fp16(x2, g2, main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(main_grad.shape, dtype=total_input.dtype, device=main_grad.device)


def install() -> None:
    """Bind megatron-core's ``fused_weight_gradient_mlp_cuda`` to this module where apex left it unbound."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]


def fusable(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Tensor]]:
    """(layer, weight) for megatron-core's column/row-parallel linears (ours included) whose weight is
    trained in bf16/fp16, and for GPTModel's LM head on a tied embedding (its weight is the embedding's,
    passed in at each forward). Frozen weights (LoRA's base, a reference model) keep the flag off."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    out = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and w is not None:
            out.append((m, w))
        head = getattr(m, "output_layer", None)
        if (
            isinstance(head, ColumnParallelLinear)
            and head.weight is None
            and getattr(m, "post_process", False)
        ):
            out.append((head, m.shared_embedding_or_output_weight()))
    return [(m, w) for m, w in out if w.requires_grad and w.dtype in HALF]


def resolve(setting, model: torch.nn.Module) -> list[tuple[torch.nn.Module, Tensor]]:
    """The (layer, weight) pairs to fuse under ``optim.gradient_accumulation_fusion`` (auto | true | false),
    [] for none: auto = ``fusable(model)`` on CUDA where ``cuda_serves``; true = them wherever they are (CPU:
    fp32 products), an error on CUDA where the trial failed; false = none."""
    if setting is False:
        return []
    pairs = fusable(model)
    if not pairs:
        return []
    w = pairs[0][1]
    if w.is_cuda:
        if cuda_serves(w.device, w.dtype):
            return pairs
        if setting is True:
            raise RuntimeError(
                "optim.gradient_accumulation_fusion=true (actor.optim or critic.optim): torch's addmm with an "
                f"fp32 output into the grad failed its trial on {w.device} (see the warning above); set it to "
                "auto or false"
            )
        return []
    return pairs if setting is True else []


def enable(pairs: list[tuple[torch.nn.Module, Tensor]]) -> list[tuple[torch.nn.Module, Tensor]]:
    """Turn megatron-core's fusion on for ``pairs`` (``resolve``'s) and return them; each weight needs a
    ``main_grad`` before a forward that is followed by a backward (``allocate_on_forward`` where the owner
    frees it between steps)."""
    install()
    for m, _ in pairs:
        m.gradient_accumulation_fusion = True
    return pairs


def allocate_on_forward(pairs: list[tuple[torch.nn.Module, Tensor]]) -> None:
    """A forward pre-hook on each fused layer: a zero fp32 ``main_grad`` for its weight where it has none
    and gradients are on (megatron-core's forward captures ``weight.main_grad``; passes without gradients,
    such as the old-log-prob and reference passes, allocate nothing)."""

    def hook(weight: Tensor):
        def before(module, args):
            if torch.is_grad_enabled() and getattr(weight, "main_grad", None) is None:
                weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)

        return before

    for m, w in pairs:
        m.register_forward_pre_hook(hook(w))
