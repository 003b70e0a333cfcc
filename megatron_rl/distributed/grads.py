"""Gradient reduction and global-norm clipping of a TP/PP-sharded model (``optim.backend=local``).

The losses are normalised by global token/sequence counts, so DP gradients are *summed*, not averaged.
Each parameter's gradient is its fp32 ``main_grad`` when the optimizer accumulates there (megatron-core's
convention, which the local backend follows), else its ``.grad``. megatron-core's own
``finalize_model_grads`` does the same for ``optim.backend=megatron``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_rl.models import unwrap


def grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    """The tensor that holds ``p``'s accumulated gradient."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _by_dtype(tensors) -> dict[torch.dtype, list[torch.Tensor]]:
    """Tensors grouped by dtype (multi-tensor ops and flattened buffers need one dtype)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def _shared_embedding(model: torch.nn.Module) -> torch.nn.Parameter | None:
    core = unwrap(model)
    if ps.get_pipeline_model_parallel_world_size() == 1 or not core.share_embeddings_and_output_weights:
        return None
    if core.pre_process or core.post_process:
        return core.shared_embedding_or_output_weight()
    return None


def _tp_partial(name: str, p: torch.nn.Parameter) -> bool:
    """TP-replicated weights whose gradient each TP rank sees only part of: norms under sequence
    parallelism (each rank holds part of the sequence) and q/k norms (each rank holds some heads).
    megatron-core's finalize_model_grads sums the same set over TP."""
    return getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name


def reduce_gradients(model: torch.nn.Module) -> None:
    """Sum grads over DP; sum partial grads of replicated weights over TP; sum the tied embedding's grad
    between the first and last PP stage. A parameter without a gradient gets zeros (every rank joins)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in named:
        if grad_of(p) is None and hasattr(p, "main_grad"):  # the optimizer accumulates in fp32 there
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        elif grad_of(p) is None:
            p.grad = torch.zeros_like(p)
    for grads in _by_dtype(grad_of(p) for _, p in named).values():
        _all_reduce_coalesced(grads, ps.get_data_parallel_group())
    _all_reduce_coalesced(
        [grad_of(p) for n, p in named if _tp_partial(n, p)], ps.get_tensor_model_parallel_group()
    )
    shared = _shared_embedding(model)
    if shared is not None and shared.requires_grad:  # frozen under LoRA
        dist.all_reduce(grad_of(shared), group=ps.get_embedding_group())


def _counts_once(p: torch.nn.Parameter, model: torch.nn.Module, shared) -> bool:
    """Whether this rank counts ``p`` in the global norm (TP-replicated params only on TP rank 0; the tied
    embedding only on the first stage)."""
    if shared is not None and p is shared and not unwrap(model).pre_process:
        return False
    sharded = getattr(p, "tensor_model_parallel", False)
    return sharded or ps.get_tensor_model_parallel_rank() == 0


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the full (unsharded) gradient over TP x PP; scale grads if above ``max_norm``."""
    params = [p for p in model.parameters() if p.requires_grad and grad_of(p) is not None]
    shared = _shared_embedding(model)
    dev = grad_of(params[0]).device if params else torch.device("cpu")
    counted = _by_dtype(grad_of(p).detach() for p in params if _counts_once(p, model, shared))
    # per-tensor norms in one multi-tensor kernel per dtype (fp32 at least), their squares summed in fp64
    norms = [
        torch.stack(torch._foreach_norm(grads, 2, dtype=torch.promote_types(dtype, torch.float32))).double()
        for dtype, grads in counted.items()
    ]
    sq = torch.cat(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64, device=dev)
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for dtype, grads in _by_dtype(grad_of(p) for p in params).items():
            torch._foreach_mul_(grads, coef.to(dtype))
    return norm.float()
