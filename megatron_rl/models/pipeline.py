"""Micro-batches through megatron-core's pipeline schedule, and results back to every pipeline rank.

The schedule contract is megatron-core's: ``forward_step(data_iterator, model) -> (output, loss_fn)``;
``loss_fn(output)`` runs on the last stage only and returns ``(loss, dict)``. The schedule divides that
loss by the number of micro-batches; our losses are already normalised by global denominators, so the
loss functions hand back ``loss * num_micro_batches`` to cancel it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.distributed.transfer import kept_host, to_device_async
from megatron_rl.kernels import rope as rope_kernel
from megatron_rl.models.head import cell_rows, set_head_positions, set_rope_positions
from megatron_rl.models.weights import unwrap
from megatron_rl.rollout.packing import PackedLayout, pad_layout, unpack


class MicroBatch(Protocol):
    """What the schedule reads of a micro-batch (``rollout.batch.MicroBatch`` is one)."""

    input_ids: torch.Tensor  # [B, T] right-padded
    score_pos: torch.Tensor  # [B, R] positions whose logits score the response tokens
    packed: PackedLayout | None  # the THD layout the model runs on instead of the rows, or None

    @property
    def seq_len(self) -> int: ...

    def __len__(self) -> int: ...


LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]


@dataclass
class ResponseLogits:
    """The logits the RL losses read (``run_micro_batches(..., response_logits=True)``): ``values`` [N, V/tp]
    at the response tokens of a micro-batch's [B, R] frame, in (b, r) order. ``cells`` [N] (flat b * R + r,
    ascending): which cells those are; None: all B * R. Cells past a response's end are padding, so the LM
    head, its gradient and the log-prob kernels skip them: on batches of spread-out lengths most of the
    frame (rows x the longest response)."""

    values: torch.Tensor  # [N, V/tp]
    cells: torch.Tensor | None  # [N] long, or None: every cell
    rows: int  # B
    width: int  # R

    def pick(self, frame: torch.Tensor) -> torch.Tensor:
        """A [B, R, ...] tensor at the cells -> [N, ...]."""
        flat = frame.reshape(self.rows * self.width, *frame.shape[2:])
        return flat if self.cells is None else flat.index_select(0, self.cells)

    def frame(self, x: torch.Tensor) -> torch.Tensor:
        """Per-cell values x [N, ...] -> [B, R, ...], zero on padding cells (differentiable in x)."""
        if self.cells is not None:
            x = x.new_zeros(self.rows * self.width, *x.shape[1:]).index_copy(0, self.cells, x)
        return x.view(self.rows, self.width, *x.shape[1:])


def response_cells(mb: MicroBatch) -> torch.Tensor | None:
    """The flat cells (b * R + r) of ``mb``'s response frame that hold response tokens (r < its length), or
    None where every cell does (or ``mb`` has no ``response_lens``). One host sync (none where the lengths kept
    their host copy): run before the schedule."""
    lens = getattr(mb, "response_lens", None)
    if lens is None:
        return None
    b, r = mb.score_pos.shape
    kept = kept_host(lens)  # a rollout batch's lengths keep their host copy: the cells made there, no sync
    lens = lens if kept is None else kept
    live = (torch.arange(r, device=lens.device)[None, :] < lens[:, None]).reshape(-1)
    cells = live.nonzero().squeeze(1)
    if cells.numel() == 0:  # no response token at all: one padding cell (masked by every loss), so N > 0
        cells = live.new_zeros(1, dtype=torch.long)
    if cells.numel() == b * r:
        return None
    return cells.to(mb.score_pos.device) if kept is None else to_device_async(cells, mb.score_pos.device)


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)  # [B, T]


def gather_positions(out: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out [B, T, ...] at positions pos [B, R] -> [B, R, ...]."""
    if out.dim() == 2:
        return out.gather(1, pos)
    return out.gather(1, pos[..., None].expand(-1, -1, out.shape[-1]))  # [B, R, V/tp]


def head_on_response(model: torch.nn.Module, mb: MicroBatch) -> bool:
    """Whether the LM head runs only at ``mb.score_pos`` (logits at the response tokens, ``ResponseLogits``)
    instead of every position: yes unless sequence parallelism is on or R >= T (short responses: nothing to
    save)."""
    return not unwrap(model).config.sequence_parallel and mb.score_pos.shape[1] < mb.seq_len


def model_shape(mb: MicroBatch) -> tuple[int, int]:
    """(rows, tokens per row) the model and the pipeline's activations see: [1, S] packed, else [B, T]."""
    return (1, mb.packed.total) if mb.packed is not None else (len(mb), mb.seq_len)


def _forward(model_chunk, mb: MicroBatch, at_response: bool, cells: torch.Tensor | None, seq_params):
    """One micro-batch through the model: its rows, or its packed row with the THD layout (the response
    scoring positions then index the packed row; ``seq_params``: its layout's ``seq_params()``, built before
    the schedule)."""
    lay = mb.packed
    if at_response:
        set_head_positions(model_chunk, mb.score_pos if lay is None else lay.score_pos, cells)
    if lay is None:
        return model_chunk(mb.input_ids, _positions(mb.input_ids), attention_mask=None)
    set_rope_positions(model_chunk, lay.positions[0])
    return model_chunk(lay.input_ids, lay.positions, attention_mask=None, packed_seq_params=seq_params)


def run_micro_batches(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    loss_fn: LossFn,
    forward_only: bool,
    response_logits: bool = False,
) -> list[dict]:
    """Run ``micro_batches`` (same T on every pipeline stage) through the schedule.

    ``response_logits``: the loss function receives ``ResponseLogits`` (logits at the response tokens
    only); the LM head computes only those where ``head_on_response`` allows, otherwise they are gathered
    from all positions. Returns the list of per-micro-batch dicts from ``loss_fn`` on the last stage, []
    elsewhere.
    """
    n = len(micro_batches)
    config = unwrap(model).config
    if config.sequence_parallel:  # the sequence is split over TP ranks: lengths must divide evenly
        tp = ps.get_tensor_model_parallel_world_size()
        for mb in micro_batches:
            if mb.packed is not None:
                mb.packed = pad_layout(mb.packed, tp)
        micro_batches = [pad_to_length(mb, -(-mb.seq_len // tp) * tp, pad_id=0) for mb in micro_batches]
    # micro-batches of different shapes (dynamic batch size): stages exchange each activation's shape
    config.variable_seq_lengths = len({model_shape(mb) for mb in micro_batches}) > 1
    # the response cells and packed-attention parameters of every micro-batch up front: any host sync they
    # make (the cells' nonzero where the lengths kept no host copy) before the schedule's work, not between
    cells = [response_cells(mb) if response_logits else None for mb in micro_batches]
    seq_params = [mb.packed.seq_params() if mb.packed is not None else None for mb in micro_batches]

    def forward_step(data_iterator, model_chunk):
        mb, mb_cells, mb_seq = next(data_iterator)
        at_response = response_logits and head_on_response(model_chunk, mb)
        out = _forward(model_chunk, mb, at_response, mb_cells, mb_seq)
        if unwrap(model_chunk).post_process:
            out = _loss_frame(out, mb, response_logits, at_response, mb_cells)
        return out, partial(_scaled, loss_fn, mb, n)

    config.pipeline_dtype = next(model.parameters()).dtype
    rows, tokens = model_shape(micro_batches[0])
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=zip(micro_batches, cells, seq_params),
            model=model,
            num_microbatches=n,
            seq_length=tokens,
            micro_batch_size=rows,
            forward_only=forward_only,
        )
    finally:  # RoPE's cos / sin tables of the pass's last micro-batch: not held through generation
        rope_kernel.release_tables()


def _loss_frame(
    out: torch.Tensor, mb: MicroBatch, response_logits: bool, at_response: bool, cells: torch.Tensor | None
) -> torch.Tensor | ResponseLogits:
    """The last stage's output in the frame the loss functions read: ``ResponseLogits`` at the response
    tokens (``response_logits``), else per-row outputs [B, T, ...] (a packed row unpacked)."""
    lay = mb.packed
    if response_logits:
        b, r = mb.score_pos.shape
        if at_response:  # [1, N | B*R, V/tp] from the response-only head
            return ResponseLogits(out.reshape(-1, out.shape[-1]), cells, b, r)
        # [B|1, T|S, V/tp] at every position: the response tokens' rows taken straight out (no [B*R, V/tp]
        # frame first: on a packed row of spread lengths that is far more than the N rows)
        row, pos = cell_rows(mb.score_pos if lay is None else lay.score_pos, out.shape[0], cells)
        return ResponseLogits(out[row, pos], cells, b, r)  # [N, V/tp]
    return out if lay is None else unpack(out, lay, mb.seq_len)  # [B, T, ...]


def _scaled(loss_fn: LossFn, mb: MicroBatch, n: int, output):
    loss, info = loss_fn(mb, output)
    return loss * n, info


def broadcast_from_last_stage(obj):
    """A picklable object from the last PP stage to every rank of this pipeline."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(
        box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return box[0]


def pad_to_length(batch: MicroBatch, length: int, pad_id: int) -> MicroBatch:
    """Right-pad ``input_ids`` to ``length`` (padding sits after every real token, so causal attention is
    unchanged for them)."""
    extra = length - batch.seq_len
    if extra > 0:
        batch.input_ids = torch.nn.functional.pad(batch.input_ids, (0, extra), value=pad_id)
    return batch
