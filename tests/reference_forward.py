"""Reference forward passes for tests and GPU checks: one stage (PP=1) and a simple whole-pipeline
forward (blocking p2p between stages). The trainer itself runs megatron-core's schedules
(``megatron_rl/models/pipeline.py``); this second path exists only to check models against transformers.
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
