"""Packed micro-batches (THD layout): a micro-batch's sequences laid end to end in one row, so the model
runs over their real tokens only (``actor.pack_sequences`` / ``critic.pack_sequences``).

The model sees ``input_ids`` [1, S] (S = the lengths' sum, plus a padding segment to a multiple of TP with
sequence parallelism), positions that restart at 0 in every sequence, and a megatron-core
``PackedSeqParams`` (``qkv_format="thd"``, ``models.packed_attention.SegmentSeqParams``): attention stays
inside each sequence (``models.packed_attention``) and RoPE reads each token's own position
(``models.head.set_rope_positions``). Shared prompts (``rollout.shared_prompts``) use the same layout. The loss
side is unchanged: ``score_pos`` [B, R] points into the packed row, so logits come back as [B, R, V/tp]
in response order and every per-token tensor of the micro-batch keeps its [B, R] frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl.distributed.transfer import host_values, to_device_async
from megatron_rl.rollout.batch import RolloutBatch, packed_groups, trim


@dataclass
class PackedLayout:
    input_ids: torch.Tensor  # [1, S] the sequences end to end (S includes the padding segment, if any)
    positions: torch.Tensor  # [1, S] position of each token inside its own sequence
    cu_seqlens: torch.Tensor  # [B + 1] (or [B + 2] with a padding segment) int32 segment starts
    max_seqlen: int  # longest segment
    starts: torch.Tensor  # [B] where sequence b starts in the packed row
    score_pos: torch.Tensor  # [B, R] packed-row positions whose logits score the response tokens
    # Shared prompts (``rollout.shared_prompts``): the row holds each prompt once and its responses as
    # segments of their own; a segment's queries attend to the keys at ``kv_index`` [Sk] rows
    # cu_seqlens_k[i]:cu_seqlens_k[i+1] (a response segment: its prompt, then itself), causally aligned
    # at the end. ``row_pos`` [B, T]: where each position of the padded row b sits in the packed row.
    kv_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int = 0
    row_pos: torch.Tensor | None = None
    real_tokens: int = 0  # shared prompts: ``real``, counted on the host where the layout was made

    @property
    def total(self) -> int:
        return self.input_ids.shape[1]

    @property
    def shared(self) -> bool:
        return self.kv_index is not None

    @property
    def real(self) -> int:
        """Shared prompts: tokens of the prompt and response segments (the row without its padding segment)."""
        return self.real_tokens

    def seq_params(self):
        """The ``models.packed_attention.SegmentSeqParams`` of this layout: to megatron-core one segment of
        ``total`` tokens whose RoPE table is indexed by ``positions`` (the largest + 1 rows long: a
        segment's length for plain packing, a prompt + response for shared prompts); shared prompts also
        carry the copies of each key row (``kernels.gather_rows.inverse``, where its kernel may run), listed
        here once for all layers."""
        from megatron_rl.kernels.gather_rows import inverse, runs_on
        from megatron_rl.models.packed_attention import SegmentSeqParams

        whole = to_device_async(torch.tensor([0, self.total], dtype=torch.int32), self.input_ids.device)
        rope_len = self.max_seqlen_k if self.shared else self.max_seqlen
        listed = self.shared and runs_on(self.kv_index.device)  # once, for every layer
        order, ptr = inverse(self.kv_index, self.total) if listed else (None, None)
        return SegmentSeqParams(
            qkv_format="thd", cu_seqlens_q=whole, cu_seqlens_kv=whole, max_seqlen_q=rope_len,
            max_seqlen_kv=rope_len, segments_q=self.cu_seqlens, max_q=self.max_seqlen, kv_index=self.kv_index,
            segments_k=self.cu_seqlens_k, max_k=self.max_seqlen_k, kv_order=order, kv_ptr=ptr,
        )  # fmt: skip


def ranges(starts: list[int], lens: list[int]) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lens)])`` [sum(lens)] (int64, CPU) in a few vector ops:
    a Python list of every index made ``torch.tensor`` spend ~0.2 s per 0.4M indices, the whole update's
    start at the GRPO benchmark shape. In numpy: 3-4x faster than the same ops in torch at these sizes (~35k
    indices: ~0.08 against ~0.25 ms; 24 calls in a GRPO step's split)."""
    n = np.asarray(lens, dtype=np.int64)
    offsets = np.cumsum(n) - n  # where each range starts in the output
    return torch.from_numpy(
        np.repeat(np.asarray(starts, dtype=np.int64) - offsets, n) + np.arange(int(n.sum()))
    )


def pack_layout(input_ids: torch.Tensor, lengths: torch.Tensor, score_pos: torch.Tensor) -> PackedLayout:
    """Right-padded rows input_ids [B, T] of ``lengths`` [B] real tokens and their scoring positions
    score_pos [B, R] -> the packed layout (padding dropped). The indices are made on the host from the
    lengths (kept host copies of a batch's: no host sync) and copied without waiting."""
    b, t = input_ids.shape
    dev = input_ids.device
    lens = host_values(lengths).long()
    if len(lens) and int(lens.max()) > t:
        raise ValueError(f"pack_layout: a sequence of {int(lens.max())} tokens in rows of {t}")
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    n = lens.tolist()
    starts = to_device_async(cu[:-1].long(), dev)  # [B]
    src = to_device_async(ranges([row * t for row in range(b)], n), dev)  # [S] each kept token's flat index
    return PackedLayout(
        input_ids=input_ids.reshape(-1)[src][None], positions=to_device_async(ranges([0] * b, n), dev)[None],
        cu_seqlens=to_device_async(cu, dev), max_seqlen=max(n, default=0), starts=starts,
        score_pos=(score_pos.to(dev) + starts[:, None]).clamp(max=int(cu[-1]) - 1),  # past an end: masked
    )  # fmt: skip


def pad_layout(layout: PackedLayout, multiple: int, pad_id: int = 0) -> PackedLayout:
    """Extend the packed row to a multiple of ``multiple`` tokens (sequence parallelism splits it over TP
    ranks) with a segment of its own, which no real token attends to."""
    extra = -layout.total % multiple
    if extra == 0:
        return layout
    dev = layout.input_ids.device
    ids = torch.cat(
        [layout.input_ids, torch.full((1, extra), pad_id, dtype=layout.input_ids.dtype, device=dev)], 1
    )
    tail = torch.arange(extra, device=dev)
    pos = torch.cat([layout.positions, tail[None]], 1)
    cu = torch.cat([layout.cu_seqlens, layout.cu_seqlens[-1:] + extra])
    padded = PackedLayout(ids, pos, cu, max(layout.max_seqlen, extra), layout.starts, layout.score_pos)
    if layout.shared:  # the padding segment attends to itself
        padded.kv_index = torch.cat([layout.kv_index, layout.total + tail])
        padded.cu_seqlens_k = torch.cat([layout.cu_seqlens_k, layout.cu_seqlens_k[-1:] + extra])
        padded.max_seqlen_k, padded.row_pos = max(layout.max_seqlen_k, extra), layout.row_pos
        padded.real_tokens = layout.real_tokens
    return padded


def unpack(out: torch.Tensor, layout: PackedLayout, t: int) -> torch.Tensor:
    """Model output over the packed row out [1, S, ...] -> right-padded rows [B, t, ...] (positions past a
    sequence's end hold some other token's value: masked by every consumer, as padding is)."""
    if layout.row_pos is not None:
        idx = layout.row_pos[:, :t]
    else:
        idx = layout.starts[:, None] + torch.arange(t, device=out.device)[None, :]
    return out[0][idx.clamp(max=layout.total - 1)]  # [B, t, ...]


def pack(mb: RolloutBatch) -> RolloutBatch:
    """``mb`` (trimmed rows) with its ``PackedLayout`` attached."""
    mb.packed = pack_layout(
        mb.input_ids, host_values(mb.prompt_lens) + host_values(mb.response_lens), mb.score_pos
    )
    return mb


def token_counts(mbs: list[RolloutBatch]) -> tuple[int, int, int]:
    """(distinct real tokens, tokens the model runs over, real tokens row by row) of micro-batches ``mbs``:
    padded rows run B x T, a packed row its length (with any padding segment); with shared prompts a
    prompt counts once per micro-batch in the first, once per sequence in the last."""
    rows = [int((host_values(mb.prompt_lens) + host_values(mb.response_lens)).sum()) for mb in mbs]
    real = sum(
        mb.packed.real if mb.packed is not None and mb.packed.shared else n for mb, n in zip(mbs, rows)
    )
    run = sum(mb.packed.total if mb.packed is not None else len(mb) * mb.seq_len for mb in mbs)
    return real, run, sum(rows)


def max_scored_rows(batch: RolloutBatch, max_tokens: int) -> int:
    """The LM-head rows (response tokens) a packed micro-batch of ``batch`` may score: no more
    than padded rows of its longest sequences give within ``max_tokens`` (the memory model's bound)."""
    return max(1, max_tokens // batch.seq_len) * batch.responses.shape[1]


def split_packed(
    batch: RolloutBatch, max_tokens: int, max_scored: int | None = None
) -> tuple[list[RolloutBatch], list[int]]:
    """``split_by_tokens`` for packed micro-batches: sequences whose lengths sum to at most ``max_tokens``
    and whose LM-head rows stay within ``max_scored`` (the memory plan's bound; default what the padded
    split of this batch allows), each micro-batch carrying its ``PackedLayout`` in ``packed``
    (``packed_groups``). Returns the micro-batches and the batch rows they hold, in order."""
    r_lens = host_values(batch.response_lens)
    lengths = host_values(batch.prompt_lens) + r_lens
    bound = max_scored_rows(batch, max_tokens) if max_scored is None else max_scored
    groups = packed_groups(lengths.tolist(), max_tokens, r_lens.tolist(), bound)
    return [pack(trim(batch.select(g))) for g in groups], [i for g in groups for i in g]
