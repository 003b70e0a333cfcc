"""Plain forward passes: one stage (PP=1) and a simple whole-pipeline forward (p2p between stages).

Training uses megatron-core's schedules; these are for evaluation, conversion checks and tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.models.weights import unwrap


def megatron_attention_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T] bool/int padding mask (1 = real token) -> megatron's [B, 1, 1, T] bool with True = masked.

    None stays None: batches are right-padded, so plain causal attention is already exact for every real
    token (padding positions come after them).
    """
    if attention_mask is None:
        return None
    return ~attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T] positions 0..T-1 (right-padded batches)."""
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """One-stage forward. input_ids [B, T] -> logits [B, T, V/tp] (actor/ref) or values [B, T] (critic).

    At PP>1 this runs only this rank's stage; use ``forward_pipeline`` for the whole model.
    """
    return model(input_ids, position_ids_for(input_ids), megatron_attention_mask(attention_mask))


def _head_pre_hook(module, args, kwargs):
    """Forward pre-hook of the LM head: with ``module._head_positions`` [B, R] set, keep only those
    positions of the hidden states [T, B, h] (as [B*R, 1, h]); the model then returns logits [1, B*R, V/tp]
    (its transpose to batch-major is free for a size-1 dim). One-shot: cleared on use."""
    pos = getattr(module, "_head_positions", None)
    if pos is None:
        return None
    module._head_positions = None
    hidden = args[0]
    t, b, h = hidden.shape
    rows = (pos * b + torch.arange(b, device=pos.device)[:, None]).reshape(-1)  # [B*R] in (b, r) order
    return (hidden.reshape(t * b, h).index_select(0, rows).unsqueeze(1), *args[1:]), kwargs


def set_head_positions(model: torch.nn.Module, positions: torch.Tensor) -> None:
    """Make the next forward of ``model`` compute LM-head logits only at ``positions`` [B, R] of each row
    (the response-scoring positions): the RL losses never read the prompt's logits, so their matmul, their
    [B, T, V/tp] tensor and its gradient are skipped. Not for sequence parallelism (the head would see
    a sequence shard). No-op on stages without the head."""
    core = unwrap(model)
    if not core.post_process:
        return
    head = core.output_layer
    if not getattr(head, "_head_hook_installed", False):
        head.register_forward_pre_hook(_head_pre_hook, with_kwargs=True)
        head._head_hook_installed = True
    head._head_positions = positions


def _p2p(tensor: torch.Tensor, peer: int, send: bool) -> None:
    group = parallel_state.get_pipeline_model_parallel_group()
    (dist.send if send else dist.recv)(tensor, peer, group=group)


@torch.no_grad()
def forward_pipeline(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Whole-model forward across PP stages; every rank of the pipeline gets the last stage's output.

    input_ids [B, T] (the same on every stage) -> logits [B, T, V/tp] or values [B, T]. Hidden states
    [T, B, h] travel stage to stage with blocking send/recv (works on gloo and NCCL). No gradients.
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return forward_logits(model, input_ids, attention_mask)
    core = unwrap(model)
    b, t = input_ids.shape
    dtype = core.config.pipeline_dtype
    if not core.pre_process:
        hidden = torch.empty(t, b, core.config.hidden_size, dtype=dtype, device=input_ids.device)  # [T, B, h]
        _p2p(hidden, parallel_state.get_pipeline_model_parallel_prev_rank(), send=False)
        core.set_input_tensor(hidden)
    out = forward_logits(model, input_ids, attention_mask)
    if not core.post_process:
        _p2p(out.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank(), send=True)
    return _broadcast_from_last_stage(out if core.post_process else None, core, b, t, input_ids.device)


def _broadcast_from_last_stage(out, core, b: int, t: int, dev) -> torch.Tensor:
    """Last stage's output [B, T(, V/tp)] to every rank of its pipeline group."""
    group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    if out is None:
        ndim = torch.empty(1, dtype=torch.long, device=dev)
    else:
        ndim = torch.tensor([out.shape[-1] if out.dim() == 3 else 0], device=dev)
    dist.broadcast(ndim, last, group=group)
    shape = (b, t, int(ndim)) if int(ndim) else (b, t)
    buf = (
        out.contiguous()
        if out is not None
        else torch.empty(shape, dtype=core.config.pipeline_dtype, device=dev)
    )
    dist.broadcast(buf, last, group=group)
    return buf
