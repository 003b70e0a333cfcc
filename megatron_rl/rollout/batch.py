"""The rollout batch of one DP rank: prompt+response token tensors and everything computed on them.

Layout: every sequence is ``prompt + response`` contiguous and right-padded, so plain causal attention
with positions 0..T-1 is exact for every real token (no left padding, no attention mask). Per-token RL
quantities live in a response-aligned ``[B, R]`` frame (R = rollout.max_new_tokens, the same on every
rank); ``score_pos`` maps response token j of row i to the position whose logits score it
(``prompt_len_i - 1 + j``: logits at t score token t + 1).
"""

from __future__ import annotations

import array
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from megatron_rl.data import PromptRow
from megatron_rl.distributed.transfer import host_copy, host_values, keep_host, to_device_async
from megatron_rl.rollout.engine import Completion


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, T] prompt + response, right-padded
    responses: torch.Tensor  # [B, R] response ids (0 past the end)
    response_mask: torch.Tensor  # [B, R] float, 1 on sampled response tokens (EOS included); multi-turn:
    # 0 inside the response on tool answers / user turns (trained on as context, not in any loss)
    score_pos: torch.Tensor  # [B, R] long: logits position scoring each response token
    prompt_lens: torch.Tensor  # [B]
    response_lens: torch.Tensor  # [B]
    group_index: torch.Tensor  # [B] global prompt id (GRPO/RLOO groups may straddle DP ranks)
    rollout_log_probs: torch.Tensor  # [B, R] sampling-time log-probs (temperature applied)
    finish_reasons: list[str]
    rows: list[PromptRow]  # the prompt row of each sequence
    response_texts: list[str] = field(default_factory=list)
    old_log_probs: torch.Tensor | None = None  # [B, R]
    ref_log_probs: torch.Tensor | None = None  # [B, R]
    values: torch.Tensor | None = None  # [B, R]
    token_level_scores: torch.Tensor | None = None  # [B, R]
    token_level_rewards: torch.Tensor | None = None  # [B, R]
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    reward_baselines: torch.Tensor | None = None  # [B] ReMax: score of the prompt's greedy sample
    rollout_is_weights: torch.Tensor | None = None  # [B, R] IS weights computed for the whole batch
    # [B, R] with top-k / top-p: log-probs under the truncated, renormalised sampling distribution
    rollout_truncated_log_probs: torch.Tensor | None = None
    # multi-turn rollouts only: assistant turns [B], tools' reward deltas [B], (calls, errors, timeouts) [B, 3]
    turns: torch.Tensor | None = None
    tool_reward: torch.Tensor | None = None
    tool_counts: torch.Tensor | None = None
    packed: Any = None  # a packed micro-batch's rollout.packing.PackedLayout; None: padded rows

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def select(self, idx: torch.Tensor | list[int]) -> RolloutBatch:
        """Rows ``idx`` of every per-sequence field (tensors indexed on dim 0, lists likewise)."""
        idx_list = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        index = torch.tensor(idx_list, dtype=torch.long)
        on_device: dict[torch.device, torch.Tensor] = {}  # one copy of the index per device, not one a field
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                if value.device not in on_device:
                    on_device[value.device] = to_device_async(index, value.device)
                kept = host_copy(value)  # the per-row tensors of build_batch: their host copies follow
                out[f.name] = keep_host(value[on_device[value.device]], None if kept is None else kept[index])
            elif isinstance(value, Deferred):
                out[f.name] = value.select(index)
            elif isinstance(value, list) and value:
                out[f.name] = [value[i] for i in idx_list]
            elif f.name == "packed":
                out[f.name] = None  # a layout describes its own rows only: select, then pack
            else:
                out[f.name] = value
        return RolloutBatch(**out)


class Pending:
    """Fields of a batch computed on first use (``reward.overlap``: the advantages and returns, whose scoring
    runs while the update's first forward is on the device). Each named field of ``batch`` becomes a
    ``Deferred``; the first ``resolve`` calls ``finish``, which sets the batch's real tensors (once)."""

    def __init__(self, batch: RolloutBatch, finish: Callable[[], None], names: tuple[str, ...]):
        self.batch, self._finish, self.done = batch, finish, False
        for name in names:
            setattr(batch, name, Deferred(self, name))

    def resolve(self) -> None:
        if not self.done:
            self._finish()
            self.done, self._finish = True, None  # the closure's buffers go


@dataclass(frozen=True, eq=False)
class Deferred:
    """A response-frame field [B, R] of ``pending.batch`` not computed yet, as a micro-batch sees it: its
    ``rows`` of the batch (int64 on the host; None: all) and its first ``cols`` columns (None: all).
    ``RolloutBatch.select`` and ``trim`` compose on it; ``resolve()`` computes the batch's field (the first
    time) and returns this view of it."""

    pending: Pending
    name: str
    rows: torch.Tensor | None = None
    cols: int | None = None

    def select(self, index: torch.Tensor) -> Deferred:
        return replace(self, rows=index if self.rows is None else self.rows[index])

    def __getitem__(self, key) -> Deferred:
        """``[:, :r]`` (``trim``'s cut to a micro-batch's longest response) and nothing else."""
        rows, cols = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        if rows != slice(None) or not isinstance(cols, slice) or cols.start or cols.step or cols.stop is None:
            raise TypeError(f"a deferred {self.name} is cut only as [:, :r], not {key!r}")
        return replace(self, cols=cols.stop if self.cols is None else min(self.cols, cols.stop))

    def resolve(self) -> torch.Tensor:
        self.pending.resolve()
        value = getattr(self.pending.batch, self.name)
        if value is None or isinstance(value, Deferred):
            raise RuntimeError(f"resolving the deferred {self.name} left the batch's field unset")
        if self.rows is not None:  # no host sync behind the queued forward
            value = value[to_device_async(self.rows, value.device)]
        return value if self.cols is None else value[:, : self.cols]


def resolved(value):
    """``value``, or the tensor a ``Deferred`` stands for."""
    return value.resolve() if isinstance(value, Deferred) else value


# the per-token fields in the response-aligned [B, R] frame
RESPONSE_FRAME = tuple(
    "responses response_mask score_pos rollout_log_probs old_log_probs ref_log_probs values token_level_scores "
    "token_level_rewards advantages returns rollout_is_weights".split()
)


def right_padded(seqs: list[list], width: int, dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
    """[len(seqs), width] whose row i is seqs[i] then ``fill``: one tensor conversion for all rows (one per
    row cost ~0.1 s for a GRPO step's 512 x 768 tokens)."""
    lens = torch.tensor([len(q) for q in seqs], dtype=torch.long)
    flat = None
    if int(lens.sum()):  # through array.array: ~7x faster than torch.tensor on a Python list
        flat = array.array({torch.long: "q", torch.float32: "f"}[dtype])
        # a row at a time: ~2x faster than array.array(code, chain(*seqs)) (GRPO's 512 x 768 ids: 4 vs 9 ms)
        for q in seqs:
            flat.fromlist(q) if type(q) is list else flat.extend(q)
        flat = torch.frombuffer(flat, dtype=dtype)
    return _placed(flat, lens, width, dtype, fill)


def _padded(parts: list, lens: torch.Tensor, width: int, dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
    """``right_padded`` from arrays (one per row, or ``parts`` as row-major pieces whose lengths per row sum to
    ``lens``): one concatenation in C, no Python values."""
    flat = torch.from_numpy(np.concatenate(parts)).to(dtype) if int(lens.sum()) else None
    return _placed(flat, lens, width, dtype, fill)


def _placed(flat: torch.Tensor | None, lens: torch.Tensor, width: int, dtype: torch.dtype, fill: float):
    """[len(lens), width] of ``fill`` with row i's first lens[i] cells taken from ``flat`` (the rows' values
    back to back; None when they are all empty) in row-major order: a slice copy a row (a boolean-mask scatter
    was most of ``build_batch``'s host time in a CPU profile, session 39)."""
    out = torch.full((len(lens), width), fill, dtype=dtype)
    if flat is not None:
        dst, src, at = out.numpy(), flat.numpy(), 0
        for i, n in enumerate(lens.tolist()):
            dst[i, :n] = src[at : at + n]
            at += n
    return out


def _from_arrays(
    completions: list[Completion], prompt_lens: torch.Tensor, response_lens: torch.Tensor, t: int, r: int,
    pad_id: int,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """input_ids [B, t], responses [B, r] and rollout log-probs [B, r] from the engine's arrays
    (``Completion.arrays``; ``prompt_lens`` / ``response_lens`` [B] the responses' lengths): each prompt's ids
    converted once, the responses copied, not listed."""
    prompts: dict[int, tuple[list, np.ndarray]] = {}  # a prompt's samples hold equal ids (checked: cheap)
    ids = []
    for c in completions:
        if not len(c.arrays[0]) == len(c.arrays[1]) == c.response_len():  # lists changed after the engine
            raise ValueError(
                f"Completion {c.prompt_index}/{c.sample_index}: its arrays hold {len(c.arrays[0])} ids and "
                f"{len(c.arrays[1])} log-probs for {c.response_len()} response ids; set arrays=None after "
                "changing response_ids or logprobs"
            )
        seen = prompts.get(c.prompt_index)
        if seen is None or seen[0] != c.prompt_ids:
            seen = prompts[c.prompt_index] = (c.prompt_ids, np.asarray(c.prompt_ids, dtype=np.int64))
        ids += (seen[1], c.arrays[0])
    return (
        _padded(ids, prompt_lens + response_lens, t, torch.long, pad_id),
        _padded([c.arrays[0] for c in completions], response_lens, r, torch.long),
        _padded([c.arrays[1] for c in completions], response_lens, r, torch.float32),
    )


def build_batch(
    completions: list[Completion],
    rows: list[PromptRow],
    group_offset: int,
    max_new_tokens: int,
    pad_id: int,
    device: torch.device,
) -> RolloutBatch:
    """Tensors from the engine's completions of this DP rank's prompts ``rows`` (ordered by prompt, sample).

    ``group_offset``: global id of ``rows[0]`` so group ids are unique across DP ranks.
    """
    b, r = len(completions), max_new_tokens
    prompt_lens = torch.tensor([len(c.prompt_ids) for c in completions])
    response_lens = torch.tensor([c.response_len() for c in completions])
    t = int((prompt_lens + response_lens).max())
    # [B, R] 0 where a multi-turn response holds appended (not sampled) ids
    multi = any(c.response_mask for c in completions)
    if completions and not multi and all(c.arrays is not None for c in completions):
        input_ids, responses, rollout_lp = _from_arrays(completions, prompt_lens, response_lens, t, r, pad_id)
    else:
        input_ids = right_padded([c.prompt_ids + c.response_ids for c in completions], t, torch.long, pad_id)
        responses = right_padded([c.response_ids for c in completions], r, torch.long)
        rollout_lp = right_padded([c.logprobs for c in completions], r, torch.float32)
    sampled = (
        right_padded([c.response_mask or [1] * r for c in completions], r, torch.float32, 1.0)
        if multi
        else torch.ones(b, r)
    )
    j = torch.arange(r)
    response_mask = (j[None, :] < response_lens[:, None]).float() * sampled  # [B, R]
    score_pos = (prompt_lens[:, None] - 1 + j[None, :]).clamp(max=t - 1)  # [B, R]
    truncated = None
    if completions and all(c.truncated_logprobs or not c.response_len() for c in completions):
        truncated = right_padded([c.truncated_logprobs for c in completions], r, torch.float32)

    # Pinned and non-blocking: a pageable copy waits for the stream (and on one H100 host took 29-72 ms for this
    # function's ~10 MB; benchmarks/results/2026-12-07-session39). ``keep``: the host copy stays with the
    # tensor, so the update's split reads lengths, group ids and prompts without a host sync (``host_values``).
    def put(value, keep: bool = False) -> torch.Tensor:
        return to_device_async(
            value if isinstance(value, torch.Tensor) else torch.tensor(value), device, keep
        )

    return RolloutBatch(
        turns=put([c.turns for c in completions]) if multi else None,
        tool_reward=put([c.tool_reward for c in completions]) if multi else None,
        tool_counts=put([c.tool_counts for c in completions]) if multi else None,
        input_ids=put(input_ids, keep=True),
        responses=put(responses),
        response_mask=put(response_mask),
        score_pos=put(score_pos),
        prompt_lens=put(prompt_lens, keep=True),
        response_lens=put(response_lens, keep=True),
        group_index=put([group_offset + c.prompt_index for c in completions], keep=True),
        rollout_log_probs=put(rollout_lp),
        rollout_truncated_log_probs=None if truncated is None else put(truncated),
        finish_reasons=[c.finish_reason or "length" for c in completions],
        rows=[rows[c.prompt_index] for c in completions],
    )


def split_micro_batches(batch: RolloutBatch, micro_size: int) -> list[RolloutBatch]:
    """Consecutive micro-batches of ``micro_size`` sequences (the caller checked divisibility)."""
    return [batch.select(range(s, s + micro_size)) for s in range(0, len(batch), micro_size)]


def trim(batch: RolloutBatch) -> RolloutBatch:
    """Drop the padding columns past the longest sequence of ``batch`` (positions past it are clamped),
    and the response-frame columns [B, R] past its longest response (callers pad per-row outputs back to R,
    ``pad_response``)."""
    p_lens, r_lens = host_values(batch.prompt_lens), host_values(batch.response_lens)  # kept: no host sync
    t = int((p_lens + r_lens).max())
    if t < batch.seq_len:
        kept = host_copy(batch.input_ids)
        batch.input_ids = keep_host(batch.input_ids[:, :t], None if kept is None else kept[:, :t])
        batch.score_pos = batch.score_pos.clamp(max=t - 1)
    r, r_mb = batch.responses.shape[1], max(1, int(r_lens.max()))
    if r_mb < r:
        for name in RESPONSE_FRAME:
            value = getattr(batch, name)
            if value is not None:
                setattr(batch, name, value[:, :r_mb])
    return batch


def pad_response(out: torch.Tensor, r: int) -> torch.Tensor:
    """A per-row output [B, r_mb] of a trimmed micro-batch -> [B, r] (zeros past r_mb)."""
    return torch.nn.functional.pad(out, (0, r - out.shape[1])) if out.shape[1] < r else out


def token_budget_groups(
    lengths: list[int], max_tokens: int, responses: list[int] | None = None, max_scored: int | None = None
) -> list[list[int]]:
    """Dynamic batch size, padded rows: indices of ``lengths`` grouped longest first, each group filled
    greedily while (its size + 1) x its longest (the first) fits ``max_tokens``. A single sequence longer
    than ``max_tokens`` gets a group of its own (the config check prevents it). ``max_scored``: also at
    most that many LM-head rows (the group's ``responses`` summed: the head scores response tokens only,
    ``models.pipeline.ResponseLogits``): the memory model's bound, which short prompts would otherwise pass
    (more sequences of the same padded length, each scoring more rows)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    scored = 0
    for i in order:
        r = responses[i] if responses is not None else 0
        fits = groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens
        if fits and max_scored is not None:
            fits = scored + r <= max_scored
        if fits:
            groups[-1].append(i)
            scored += r
        else:
            groups.append([i])
            scored = r
    return groups


def packed_groups(
    lengths: list[int], max_tokens: int, responses: list[int] | None = None, max_scored: int | None = None
) -> list[list[int]]:
    """Dynamic batch size, packed sequences: as ``token_budget_groups`` but a group holds sequences whose
    lengths sum to at most ``max_tokens`` (no padding to count), longest first. ``max_scored``: also at
    most that many LM-head rows (the group's ``responses`` summed), the bound the padded split keeps and
    the memory model assumes."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    total = scored = 0
    for i in order:
        r = responses[i] if responses is not None else 0
        fits = groups and total + lengths[i] <= max_tokens
        if fits and max_scored is not None:
            fits = scored + r <= max_scored
        if fits:
            groups[-1].append(i)
            total, scored = total + lengths[i], scored + r
        else:
            groups.append([i])
            total, scored = lengths[i], r
    return groups


def padded_fraction(lengths: list[int], groups: list[list[int]], packed: bool = False) -> float:
    """Padded tokens / all tokens the model runs over for micro-batches ``groups`` of sequences of
    ``lengths``: padded rows run size x longest tokens per group; packed ones exactly their lengths."""
    real = sum(lengths[i] for g in groups for i in g)
    run = real if packed else sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1.0 - real / run if run else 0.0


def split_by_tokens(
    batch: RolloutBatch, max_tokens: int, max_scored: int | None = None
) -> tuple[list[RolloutBatch], list[int]]:
    """Dynamic batch size: micro-batches of similar-length sequences holding at most ``max_tokens``
    padded tokens each (``token_budget_groups``; and at most ``max_scored`` LM-head rows, the memory
    plan's bound), each trimmed to its own longest sequence.

    Longest first, greedily filled, so padding is small and few, large micro-batches run. Returns the
    micro-batches and ``order``: micro-batch rows, concatenated, are ``batch`` rows ``order``.
    """
    p_lens, r_lens = host_values(batch.prompt_lens), host_values(batch.response_lens)
    groups = token_budget_groups((p_lens + r_lens).tolist(), max_tokens, r_lens.tolist(), max_scored)
    return [trim(batch.select(g)) for g in groups], [i for g in groups for i in g]
