"""Per-micro-batch positions for the model's position-dependent parts, set before its forward: logits at
chosen positions only (the RL losses read the LM head's output at the response-scoring positions, so the
prompt's logits, their matmul, their [B, T, V/tp] tensor and its gradient are skipped), and RoPE at each
packed token's own position."""

from __future__ import annotations

import torch

from megatron_rl.models.weights import unwrap


def _head_pre_hook(module, args, kwargs):
    """Forward pre-hook of the LM head: with ``module._head_positions`` [B, R] set, keep only those
    positions of the hidden states [T, B, h] (as [B*R, 1, h]; with ``module._head_cells`` [N] set, only
    those flat (b, r) cells: [N, 1, h]); the model then returns logits [1, B*R | N, V/tp] (its transpose to
    batch-major is free for a size-1 dim). One-shot: cleared on use."""
    pos = getattr(module, "_head_positions", None)
    if pos is None:
        return None
    cells, module._head_positions, module._head_cells = getattr(module, "_head_cells", None), None, None
    hidden = args[0]
    t, b, h = hidden.shape
    row, at = cell_rows(pos, b, cells)
    return (hidden.reshape(t * b, h).index_select(0, at * b + row).unsqueeze(1), *args[1:]), kwargs


def cell_rows(pos: torch.Tensor, batch: int, cells: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [N], position [N]) of the scored cells of an output with ``batch`` rows (B, or 1 for a packed
    row): ``pos`` [B, R] the cells' positions, in (b, r) order; ``cells`` [N] (flat b * R + r): only those,
    else all B * R."""
    row = torch.arange(batch, device=pos.device)[:, None].expand_as(pos).reshape(-1)
    pos = pos.reshape(-1)
    if cells is not None:
        row, pos = row.index_select(0, cells), pos.index_select(0, cells)
    return row, pos


def set_head_positions(
    model: torch.nn.Module, positions: torch.Tensor, cells: torch.Tensor | None = None
) -> None:
    """Make the next forward of ``model`` compute LM-head logits only at ``positions`` [B, R] of each row
    (the response-scoring positions): the RL losses never read the prompt's logits, so their matmul, their
    [B, T, V/tp] tensor and its gradient are skipped. ``cells`` [N] (flat b * R + r, ascending): only those
    (the response tokens; past a response's end the frame is padding). Not for sequence parallelism (the
    head would see a sequence shard). No-op on stages without the head."""
    core = unwrap(model)
    if not core.post_process:
        return
    head = core.output_layer
    if not getattr(head, "_head_hook_installed", False):
        head.register_forward_pre_hook(_head_pre_hook, with_kwargs=True)
        head._head_hook_installed = True
    head._head_positions, head._head_cells = positions, cells


def _rope_hook(module, args, output):
    """Forward hook of the rotary module: its table [L, 1, 1, D] for positions 0..L-1 -> the rows of
    ``module._rope_positions`` [S] (one per packed token). One-shot: cleared on use."""
    pos = getattr(module, "_rope_positions", None)
    if pos is None:
        return None
    module._rope_positions = None
    return output.index_select(0, pos)  # [S, 1, 1, D]


def set_rope_positions(model: torch.nn.Module, positions: torch.Tensor) -> None:
    """Make the next forward of ``model`` rotate packed token s by the angle of ``positions[s]`` ([S]): its
    position inside its own sequence (a shared-prompt response continues from its prompt's length).
    megatron-core then reads the table as one THD segment (``models.packed_attention.SegmentSeqParams``)."""
    rope = unwrap(model).rotary_pos_emb
    if not getattr(rope, "_rope_hook_installed", False):
        rope.register_forward_hook(_rope_hook)
        rope._rope_hook_installed = True
    rope._rope_positions = positions
