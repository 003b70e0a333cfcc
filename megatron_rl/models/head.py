"""Logits at chosen positions only: the RL losses read the LM head's output at the response-scoring
positions, so the prompt's logits (their matmul, their [B, T, V/tp] tensor and its gradient) are skipped."""

from __future__ import annotations

import torch

from megatron_rl.models.weights import unwrap


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
